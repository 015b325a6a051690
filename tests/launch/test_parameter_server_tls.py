"""``loom run --ps N --ps-tls-cert C --ps-tls-key K``: a half-set TLS configuration stops the job before it starts.

A job with TLS that trains is one of the asynchronous job's tests (test_parameter_server_job.py).
"""

from loom.launch.cli import main
from tests.helpers import SCRIPTS
from tests.strategies.parameter_server.test_transport import self_signed


def test_a_half_set_tls_configuration_stops_the_job_before_it_starts(tmp_path, capsys):
    cert, _ = self_signed(tmp_path, "job")
    command = ["run", "--ps", "1", "--workers", "1", "--ps-checkpoint-dir", str(tmp_path / "ps"), "--ps-tls-cert", str(cert),
               str(SCRIPTS / "ps_train.py"), "x", "1"]  # fmt: skip
    assert main(command) == 2
    assert capsys.readouterr().err == (
        "loom: error: LOOM_PS_TLS_CERT is set but LOOM_PS_TLS_KEY is not: a parameter server needs its certificate's private key\n"
    )
    assert not (tmp_path / "ps").exists()  # nothing started, nothing written
