from pipeline.torch_logs import quiet_cpp_logs

quiet_cpp_logs()  # before torch loads: no C++ backtraces on stderr

from actor.main import main  # noqa: E402
from pipeline.runtime import run_main  # noqa: E402

run_main(main)
