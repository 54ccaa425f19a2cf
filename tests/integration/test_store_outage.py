"""A store outage mid-run is waited out: the S3 endpoint (moto on loopback) stops while a commit is due and comes
back OUTAGE_S later; the commit waits for it (the ranks keep their snapshot and train on), one warning line says
so, nothing committed is lost, and the run ends with the weights of an uninterrupted one. Before, the commit's
EndpointConnectionError failed the chunk, its retries met the same outage at the store's listing (a user error,
exit 2), and the run ended. The limit (--store_outage_s) and the backoff are in tests/unit/test_outage.py; the
soak's 2-minute outage is `make soak`'s."""

from __future__ import annotations

import subprocess
import time

import pytest
from safetensors.torch import load_file

from tests.conftest import RLHF, make_bucket, s3_environment
from tests.integration.conftest import train_sft_args

pytestmark = pytest.mark.slow
OUTAGE_S = 25  # longer than s3fs's own retries (about 12 s here), so the commit itself has to wait


def committed_steps(endpoint: str, bucket: str, prefix: str) -> list[int]:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                      aws_secret_access_key="testing-secret", region_name="us-east-1")
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return sorted(int(item["Key"].split("/step_")[1].split("/")[0]) for item in listed
                  if item["Key"].endswith("/MANIFEST.json"))


def test_a_store_outage_mid_run_is_waited_out_and_loses_nothing(toy_assets, rlhf_env, reference_sft_weights,
                                                               tmp_path):
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    make_bucket(endpoint, "outage-test")
    (tmp_path / "faults").mkdir()
    env = {**rlhf_env, **s3_environment(endpoint), "RLHF_FAULT_STATE": str(tmp_path / "faults"),
           "RLHF_FAULT_INJECT": "train_step@8=sleep:6"}  # time to stop the store inside chunk 2
    args = train_sft_args(toy_assets, "s3://outage-test/ckpt", tmp_path / "out")
    run = subprocess.Popen([RLHF, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while not ((tmp_path / "faults" / "train_step@8").exists()
                   and committed_steps(endpoint, "outage-test", "ckpt/rlhf/sft/") == [5]):
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()[0][-4000:]
            time.sleep(0.2)
        time.sleep(1.5)  # the flow's own calls after the commit of step 5 (its events, the ledger) are done
        server.stop()  # inside chunk 2, the rank paused at step 8: the commit of step 10 meets the outage
        time.sleep(OUTAGE_S)
        assert run.poll() is None, run.communicate()[0][-4000:]  # waiting, not failed
        server = ThreadedMotoServer(ip_address=host, port=port, verbose=False)  # moto keeps its buckets in-process
        server.start()
        output, _ = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
        server.stop()
    assert run.returncode == 0, output[-4000:]
    warnings = [line for line in output.splitlines() if "the store is unreachable" in line]
    assert len(warnings) == 1 and "the commit of step 10 waits for it" in warnings[0], output[-4000:]
    actual = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, tensor in reference_sft_weights.items():
        assert actual[name].equal(tensor), f"{name} differs from the uninterrupted run"
