from pipeline.runtime import run_main
from preprocessor.main import main

run_main(main)
