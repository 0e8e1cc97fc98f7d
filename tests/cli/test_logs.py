"""The library logs; the command line shows the messages as they are, on stderr."""

import logging
import subprocess
import sys

from meshkit.cli.logs import log_to_stderr


def test_messages_go_to_the_stderr_of_the_moment_and_the_logger_is_restored(capsys):
    logger = logging.getLogger("meshkit")
    before = logger.level, logger.propagate, list(logger.handlers)
    with log_to_stderr():
        logging.getLogger("meshkit.training.loop").info("meshkit train: starting; x")
        logging.getLogger("meshkit.training.loop").debug("not shown")
        logging.getLogger("other").warning("not ours")
    assert capsys.readouterr().err.splitlines() == ["meshkit train: starting; x"]
    assert (logger.level, logger.propagate, list(logger.handlers)) == before


def test_the_command_names_itself_where_the_library_says_meshkit(capsys):
    with log_to_stderr(prog="meshkit train"):
        logging.getLogger("meshkit.training.recovery").warning("meshkit: warning: damaged")
        logging.getLogger("meshkit.training.loop").info("step 3: eval loss 2.0\n  meshkit: x")
    assert capsys.readouterr().err.splitlines() == [
        "meshkit train: warning: damaged", "step 3: eval loss 2.0", "  meshkit: x"]


def test_a_script_without_logging_set_up_still_sees_warnings(tmp_path):
    # Python shows WARNING and above on stderr without any setup: the message alone (its
    # last-resort handler) or, since importing orbax calls logging.basicConfig, after
    # "WARNING:<logger>:".
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n[2]\n')
    code = ("import sys; from meshkit.training.metrics import MetricsWriter\n"
            "MetricsWriter(sys.argv[1], resume_step=5).close()")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, check=True)
    assert done.stderr.endswith(f"meshkit: warning: {tmp_path}/metrics.jsonl:2: expected a "
                                "JSON object; dropped it\n")
    assert len(done.stderr.splitlines()) == 1
