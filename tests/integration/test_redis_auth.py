"""Redis with a password (`requirepass`), as compose runs it: a client without the password
is refused, and every process takes the password from the credentials in its Redis URL."""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx
import pytest
import redis
import yaml
from helpers import wait_for

from devtools.provider import LocalUpstreamConfig, serve_in_thread
from devtools.provider import create_app as create_upstream
from tandem.launcher import Ports, Stack
from tandem.redis_embed import EmbeddedRedis, free_port


def test_the_embedded_redis_with_a_password_refuses_a_client_without_it():
    with EmbeddedRedis(password="hunter2") as server:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port).set("job", "forged")
        assert server.url == f"redis://:hunter2@127.0.0.1:{server.port}/0"
        assert redis.Redis.from_url(server.url).ping()


@pytest.mark.slow
def test_every_process_runs_a_job_on_the_password_protected_redis_tandem_up_starts(tmp_path, tiny_model):
    upstream = create_upstream(LocalUpstreamConfig(models=["judge"], tpm=200_000, rpm=2000))
    with serve_in_thread(upstream, free_port()) as upstream_url:
        upstreams = tmp_path / "upstreams.yaml"
        upstreams.write_text(
            yaml.safe_dump(
                {
                    "upstreams": [
                        {
                            "name": "local",
                            "model": "judge",
                            "base_url": f"{upstream_url}/v1",
                            "tpm": 200_000,
                            "rpm": 2000,
                        }
                    ]
                }
            )
        )
        env = {"TANDEM_UPSTREAMS": str(upstreams), "TANDEM_RUNS_DIR": str(tmp_path / "runs")}
        with Stack(tmp_path / "logs", ports=Ports.free(), extra_env=env) as stack:
            with pytest.raises(redis.AuthenticationError):
                redis.Redis(port=urlsplit(stack.redis_url).port).ping()
            judged = httpx.post(
                f"{stack.judge_url}/v1/chat/completions",
                timeout=30,
                json={"model": "judge", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]},
            )
            api = httpx.Client(base_url=stack.api_url, timeout=10)
            job_id = api.post(
                "/v1/jobs",
                json={
                    "name": "auth",
                    "model": {"path": str(tiny_model), "max_model_len": 512},
                    "rollout": {"group_size": 4, "max_new_tokens": 8, "max_turns": 2, "max_total_tokens": 128},
                    "train": {"num_steps": 2, "batch_size": 2, "lr": 1e-4},
                },
            ).json()["id"]
            final = wait_for(
                lambda: (
                    (r := api.get(f"/v1/jobs/{job_id}").json())["status"] in ("SUCCEEDED", "FAILED", "CANCELLED") and r
                ),
                300,
                "the job to end",
                interval_s=0.5,
            )

    assert judged.status_code == 200, judged.text  # the proxy's shared budget lives in Redis
    assert (final["status"], final["error"]) == ("SUCCEEDED", None)
    assert final["step"] == 2
