"""What a hostile tenant may not do, tried against the real job API, judge proxy and tools:
start a program or pick an address through a tool, read a file outside the operator's
roots through a tool's data, take more of the judge budget than the operator allows, charge
its judge calls to another job, or reach a server that runs without auth from elsewhere."""

from __future__ import annotations

import json
import sys

import httpx
import pytest
from prometheus_client import REGISTRY

from devtools.provider import LocalUpstreamConfig, serve_in_thread
from devtools.provider import create_app as local_upstream_app
from judge_proxy.app import create_app as proxy_app
from rollout.tools.box import ToolBox
from rollout.tools.search import load_documents
from services.api.app import create_app as api_app
from services.auth import job_credential
from services.config import ApiSettings, JudgeProxySettings, McpServerSpec, ToolCatalog, ToolsSpec
from services.judge_client import JudgeClient
from services.tool_catalog import check_public_url
from tandem.redis_embed import free_port

TOKEN = "alpha-token-0123456789"
SERVER_SCRIPT = "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text('ran')"


@pytest.fixture
def roots(tmp_path):
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "models" / "docs.jsonl").write_text('{"id": "1", "title": "t", "text": "x"}\n')
    (tmp_path / "secret.jsonl").write_text('{"id": "1", "title": "key", "text": "hunter2"}\n')
    return tmp_path


@pytest.fixture
async def api(redis_url, redis_client, roots, tmp_path):
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(json.dumps({"mcp_servers": {"fetch": {"url": "https://mcp.example.com/mcp"}}}))
    settings = ApiSettings(
        redis_url=redis_url,
        tokens=f"{TOKEN}:alpha",
        path_roots=str(roots / "models"),
        tool_catalog=str(catalog),
        max_judge_weight=4,
    )
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api_app(settings)),
        base_url="http://api",
        headers={"authorization": f"Bearer {TOKEN}"},
    ) as client:
        yield client


def job_with_tools(roots, *tools: dict, **tools_section) -> dict:
    return {
        "name": "t",
        "model": {"path": str(roots / "models" / "tiny")},
        "tools": {"tools": list(tools), **tools_section},
    }


@pytest.mark.parametrize(
    "server",
    [
        {"command": [sys.executable, "-c", "print('owned')"]},
        {"url": "http://127.0.0.1:6379/"},
        {"url": "http://169.254.169.254/latest/meta-data/"},
    ],
)
async def test_a_tenants_inline_mcp_server_is_refused_with_422_naming_the_field(api, roots, server):
    response = await api.post("/v1/jobs", json=job_with_tools(roots, {"name": "x", "kind": "mcp", "server": server}))

    assert response.status_code == 422
    [error] = response.json()["detail"]
    assert error["loc"] == ["body", "tools", "tools", 0, "server"]
    assert "TANDEM_ALLOW_INLINE_MCP" in error["msg"]


async def test_an_mcp_tool_names_a_server_of_the_operators_catalogue(api, roots):
    known = await api.post("/v1/jobs", json=job_with_tools(roots, {"name": "fetch", "kind": "mcp", "server": "fetch"}))
    unknown = await api.post("/v1/jobs", json=job_with_tools(roots, {"name": "x", "kind": "mcp", "server": "shell"}))

    assert known.status_code == 201
    assert unknown.status_code == 422
    assert "no MCP server 'shell'" in unknown.json()["detail"][0]["msg"]


async def test_a_tools_file_may_not_name_an_inline_server_or_a_data_file_outside_the_roots(api, roots):
    inline = roots / "models" / "inline.yaml"
    inline.write_text(json.dumps({"tools": [{"name": "x", "kind": "mcp", "server": {"command": ["sh"]}}]}))
    leaky = roots / "models" / "leaky.yaml"
    leaky.write_text(json.dumps({"tools": [{"name": "s", "kind": "search", "data": str(roots / "secret.jsonl")}]}))

    for path in (inline, leaky):
        response = await api.post("/v1/jobs", json=job_with_tools(roots, file=str(path)))
        assert response.status_code == 422
        assert response.json()["detail"][0]["loc"] == ["body", "tools", "file"]


@pytest.mark.parametrize("data", ["secret.jsonl", "models/../secret.jsonl", "/dev/zero"])
async def test_a_search_tools_data_outside_the_roots_is_refused(api, roots, data):
    path = data if data.startswith("/") else str(roots / data)
    response = await api.post("/v1/jobs", json=job_with_tools(roots, {"name": "s", "kind": "search", "data": path}))

    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "tools", "tools", 0, "data"]


async def test_a_search_tools_data_inside_the_roots_is_kept_resolved(api, redis_client, roots):
    data = f"{roots}/models/../models/docs.jsonl"
    response = await api.post("/v1/jobs", json=job_with_tools(roots, {"name": "s", "kind": "search", "data": data}))

    assert response.status_code == 201
    job = (await api.get(f"/v1/jobs/{response.json()['id']}")).json()
    assert job["spec"]["tools"]["tools"][0]["data"] == str(roots / "models" / "docs.jsonl")


def test_a_search_tool_loads_only_a_regular_file():
    with pytest.raises(ValueError, match="not a regular file"):
        load_documents(__import__("pathlib").Path("/dev/zero"))


async def test_a_judge_weight_above_the_operators_cap_gets_422(api, roots):
    spec = {"name": "t", "model": {"path": str(roots / "models" / "tiny")}}
    over = await api.post("/v1/jobs", json={**spec, "judge_weight": 1000})
    at_cap = await api.post("/v1/jobs", json={**spec, "judge_weight": 4})

    assert over.status_code == 422 and over.json()["detail"][0]["loc"] == ["body", "judge_weight"]
    assert at_cap.status_code == 201


async def test_a_rollout_server_starts_no_inline_mcp_server_unless_the_operator_allows_it(tmp_path):
    marker = tmp_path / "ran"
    tools = ToolsSpec(
        tools=[{"name": "x", "kind": "mcp", "server": {"command": [sys.executable, "-c", SERVER_SCRIPT, str(marker)]}}]
    )

    with pytest.raises(ValueError, match=r"tools.tools\[0\].server: .*TANDEM_ALLOW_INLINE_MCP"):
        await ToolBox.open(tools, "job-1", ToolCatalog(), allow_inline_mcp=False)
    assert not marker.exists()


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8001/v1",
        "http://localhost:6379/",
        "http://10.0.0.7/mcp",
        "http://169.254.169.254/latest/",
        "http://[::1]:80/",
        "http://[fd00::1]/",
    ],
)
def test_an_inline_mcp_url_must_reach_a_public_address(url):
    with pytest.raises(ValueError, match="not a public address"):
        check_public_url(url)


def test_an_inline_mcp_url_to_a_public_address_passes():
    check_public_url("https://93.184.215.14/mcp")  # an address literal: no DNS needed


async def test_an_allowed_inline_url_to_a_private_address_is_refused_before_any_connection():
    tools = ToolsSpec(tools=[{"name": "x", "kind": "mcp", "server": {"url": "http://127.0.0.1:9/mcp"}}])

    with pytest.raises(ValueError, match="not a public address"):
        await ToolBox.open(tools, "job-1", ToolCatalog(), allow_inline_mcp=True)


def test_a_catalogue_server_is_what_the_rollout_server_starts(tmp_path):
    from services.tool_catalog import bind_servers

    server = McpServerSpec(command=[sys.executable, "-c", SERVER_SCRIPT, str(tmp_path / "ran")])
    bound = bind_servers(
        ToolsSpec(tools=[{"name": "x", "kind": "mcp", "server": "local"}]),
        ToolCatalog(mcp_servers={"local": server}),
        allow_inline=False,
    )

    assert bound.tools[0].server == server


@pytest.mark.parametrize(
    "settings, variable",
    [
        (lambda: ApiSettings(host="0.0.0.0"), "TANDEM_TOKENS"),
        (lambda: JudgeProxySettings(host="0.0.0.0"), "TANDEM_CLIENT_TOKENS"),
        (lambda: ApiSettings(host="10.1.2.3", tokens="  "), "TANDEM_TOKENS"),
    ],
)
def test_a_server_without_tokens_refuses_to_listen_beyond_loopback(settings, variable):
    with pytest.raises(ValueError, match=f"{variable} is empty"):
        settings()


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.53", "::1", "localhost"])
def test_a_server_without_tokens_may_listen_on_loopback(host):
    assert ApiSettings(host=host).host == JudgeProxySettings(host=host).host == host


@pytest.fixture
def proxy_url(redis_url, tmp_path):
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    config = LocalUpstreamConfig(tpm=6_000_000, rpm=60_000, service_ms=0, seed=2)
    with serve_in_thread(local_upstream_app(config), free_port()) as upstream:
        path = tmp_path / "upstreams.json"
        path.write_text(
            json.dumps(
                {
                    "upstreams": [
                        {
                            "name": "a",
                            "model": "judge",
                            "upstream_model": "local-model",
                            "base_url": f"{upstream}/v1",
                            "tpm": 100_000,
                            "rpm": 1000,
                        }
                    ]
                }
            )
        )
        settings = JudgeProxySettings(redis_url=redis_url, upstreams=str(path), client_tokens=TOKEN)
        with serve_in_thread(proxy_app(settings), free_port()) as url:
            yield url


def charged(job: str) -> float:
    return sum(
        REGISTRY.get_sample_value("tandem_judge_job_tokens_total", {"job": job, "priority": p}) or 0.0
        for p in ("judge", "simulator")
    )


CHAT = {"model": "judge", "messages": [{"role": "user", "content": "Rate this reply."}], "max_tokens": 8}


def test_a_caller_cannot_charge_another_job(proxy_url):
    mine = job_credential(TOKEN, "mine-00000001")
    forged = mine.rsplit(".", 1)[0].replace("mine-00000001", "theirs-0000002") + "." + "0" * 64

    as_other = httpx.post(
        f"{proxy_url}/v1/chat/completions",
        json=CHAT,
        headers={"authorization": f"Bearer {mine}", "x-tandem-job": "theirs-0000002"},
    )
    with_forged = httpx.post(
        f"{proxy_url}/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {forged}"}
    )
    plain_token_claim = httpx.post(
        f"{proxy_url}/v1/chat/completions",
        json=CHAT,
        headers={"authorization": f"Bearer {TOKEN}", "x-tandem-job": "theirs-0000002"},
    )

    assert as_other.status_code == 403 and "not the job this credential" in as_other.json()["error"]["message"]
    assert with_forged.status_code == 401
    assert plain_token_claim.status_code == 403
    assert charged("theirs-0000002") == 0


async def test_a_rollout_servers_calls_are_charged_to_the_job_they_name(proxy_url):
    before = charged("mine-00000001")
    client = JudgeClient(proxy_url, token=TOKEN)
    try:
        await client.chat(CHAT["messages"], model="judge", max_tokens=8, job="mine-00000001")
    finally:
        await client.aclose()

    assert charged("mine-00000001") > before


@pytest.mark.parametrize(
    "text",
    [
        "mcp_servers: [not, a, mapping]",
        "mcp_servers: {x: {command: [a], url: 'http://b'}}",
        "mcp_servers: {x: {shell: rm}}",
        "{unclosed",
    ],
)
def test_a_bad_tool_catalogue_stops_the_process_naming_the_file(tmp_path, text):
    from services.tool_catalog import load_catalog

    path = tmp_path / "catalog.yaml"
    path.write_text(text)

    with pytest.raises(ValueError, match=f"tool catalogue '{path}'"):
        load_catalog(str(path))
    with pytest.raises(ValueError, match="tool catalogue"):
        api_app(ApiSettings(tool_catalog=str(path)))  # the API does not start on it
