from pipeline.runtime import run_main
from trainer.main import main

run_main(main)
