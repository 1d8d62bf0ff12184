from actor.main import main
from pipeline.runtime import run_main

run_main(main)
