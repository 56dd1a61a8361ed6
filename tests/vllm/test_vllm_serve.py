"""vLLM serving spear checkpoints through the plugin: greedy tokens equal spear's own engine's.

Needs vLLM (its CPU build in .venv-vllm, ``scripts/setup.sh --vllm``); marked ``vllm`` and left out
of the default selection (minutes on 2 cores). Run from the repository root:

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python -m pytest -m vllm tests/vllm -q

The checkpoints are the default model's: RTN W4 per-channel symmetric (``spear quantize``), W4 with
ungated low-rank ECs (``spear quantize --compensator identity``), and W4 with a mix of gated,
ungated and absent ECs per layer (tests/vllm/_checkpoints.py). Both sides run fp32 on the CPU.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup.sh --vllm makes .venv-vllm with it)")

from tests.vllm._checkpoints import write_compensated  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
MAX_TOKENS = 24
RUNNER = Path(__file__).with_name("_run_vllm.py")
ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}


def _spear(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "spear", "-q", *args], check=True, cwd=ROOT)


def _vllm_runs(checkpoints: list[Path], tp: int = 1, compile: bool = False) -> dict[str, dict]:
    """Per checkpoint: prompt_token_ids, token_ids and the chosen tokens' logprobs of greedy decoding
    (vLLM picks the method from config.json: no --quantization)."""
    out = subprocess.run([sys.executable, str(RUNNER), "--dtype", "float32", "--tp", str(tp), "--max-tokens",
                          str(MAX_TOKENS), *(["--compile"] if compile else []), json.dumps(PROMPTS),
                          *map(str, checkpoints)],
                         capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=1800)
    if out.returncode:
        raise AssertionError(f"vLLM failed ({out.returncode}):\n{out.stderr[-6000:]}")
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {r["checkpoint"]: r for r in rows}


@torch.no_grad()
def _spear_greedy(checkpoint: Path) -> dict:
    """spear's engine: greedy token_ids, and the log-probability of each chosen token under the
    same checkpoint loaded as a transformers model (QuantLinear with its compensators), one forward
    over prompt + output. The log-probabilities are a finer check than the tokens, whose top choice
    can survive a wrong shard."""
    from spear.models.loading import load_model
    from spear.serve.config import EngineConfig
    from spear.serve.frontend.llm_engine import LLMEngine
    from spear.serve.core.messages import SamplingParams

    engine = LLMEngine.from_pretrained(str(checkpoint), config=EngineConfig(max_model_len=512, kv_memory=64 << 20),
                                       dtype=torch.float32, device="cpu")
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    tokens, logprobs = [o.output_token_ids for o in outs], []
    model, _ = load_model(checkpoint)  # the engine runs its own model; transformers' one scores
    for prompt, gen in zip(PROMPTS, tokens):
        ids = engine.tokenize(prompt)
        lp = model(torch.tensor([ids + gen])).logits[0].float().log_softmax(-1)
        logprobs.append([float(lp[len(ids) - 1 + i, t]) for i, t in enumerate(gen)])
    return {"token_ids": tokens, "logprobs": logprobs}


def _assert_same_greedy(got: dict, want: dict) -> None:
    assert got["token_ids"] == want["token_ids"]
    for g, w in zip(got["logprobs"], want["logprobs"], strict=True):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), rtol=0, atol=2e-3)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, default_model_path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm-ckpts")
    w4, lowrank = root / "w4", root / "w4-lowrank"
    _spear("quantize", "--model", "smollm2-135m", "--out", str(w4))
    _spear("quantize", "--model", "smollm2-135m", "--out", str(lowrank), "--compensator", "identity", "--rank", "8")
    gated, _ = write_compensated(w4, root / "w4-gated", seed=0)
    return {"w4": w4, "w4-lowrank": lowrank, "w4-gated": gated}


@pytest.fixture(scope="session")
def spear_runs(checkpoints) -> dict[str, dict]:
    return {name: _spear_greedy(path) for name, path in checkpoints.items()}


@pytest.fixture(scope="session")
def vllm_runs(checkpoints) -> dict[str, dict]:
    got = _vllm_runs(list(checkpoints.values()))
    return {name: got[str(path)] for name, path in checkpoints.items()}


@pytest.mark.parametrize("name", ["w4", "w4-lowrank", "w4-gated"])
def test_greedy_equals_spear_engine(name, vllm_runs, spear_runs):
    _assert_same_greedy(vllm_runs[name], spear_runs[name])


def test_compensators_change_the_output(spear_runs):
    # otherwise equality above would not show that vLLM applies them
    assert spear_runs["w4-lowrank"]["token_ids"] != spear_runs["w4"]["token_ids"]
    assert spear_runs["w4-gated"]["token_ids"] != spear_runs["w4"]["token_ids"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_openai_server_detects_spear_from_config_json(checkpoints, spear_runs, tmp_path):
    """vLLM's OpenAI server on a checkpoint as spear writes it, without --quantization (config.json
    names the method), and the official OpenAI client: the completions' tokens equal spear's
    engine's. (The server module rather than ``vllm serve``: vllm-cpu 0.32.0's ``vllm`` command asks
    for the metadata of a distribution named "vllm" and stops with PackageNotFoundError; it is
    named "vllm-cpu".)"""
    import openai

    ckpt = checkpoints["w4-gated"]
    assert json.loads((ckpt / "config.json").read_text())["quantization_config"]["quant_method"] == "spear"
    port = _free_port()
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt), "--host",
                               "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "512",
                               "--enforce-eager", "--seed", "0"], stdout=log, stderr=subprocess.STDOUT,
                              env=_env(), cwd=ROOT)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        deadline = time.monotonic() + 900
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if server.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    raise AssertionError("vllm serve did not come up:\n"
                                         + (tmp_path / "server.log").read_text()[-6000:]) from None
                time.sleep(2)
        for prompt, want in zip(PROMPTS, spear_runs["w4-gated"]["token_ids"]):
            r = client.completions.create(model=str(ckpt), prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"return_token_ids": True})
            assert r.choices[0].model_extra["token_ids"] == want
            assert r.usage.completion_tokens == len(want)
    finally:
        server.terminate()
        server.wait(60)
        log.close()


def test_compiled_mode_equals_spear_engine(checkpoints, spear_runs):
    """vLLM's compiled mode (no enforce_eager: Dynamo traces the model with the plugin's apply, the
    token dimension dynamic, and the op as one node): the same greedy tokens. Minutes: a cold
    compile cache on the CPU build."""
    ckpt = checkpoints["w4-gated"]
    _assert_same_greedy(_vllm_runs([ckpt], compile=True)[str(ckpt)], spear_runs["w4-gated"])


@pytest.fixture(scope="session")
def tp_checkpoint(tmp_path_factory, tokenizer) -> Path:
    """A random 2-layer Llama whose heads split over two ranks (the default model's 9 do not),
    W4 with the mixed ECs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("vllm-tp")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, initializer_range=0.1)
    LlamaForCausalLM(cfg).eval().save_pretrained(root / "fp")
    tokenizer.save_pretrained(root / "fp")
    _spear("quantize", "--model", str(root / "fp"), "--out", str(root / "w4"))
    return write_compensated(root / "w4", root / "w4-gated", seed=1)[0]


def test_tensor_parallel_2_equals_spear_engine(tp_checkpoint):
    """Two CPU ranks: column-parallel A whole and B split, row-parallel A split, u all-reduced
    before the row-parallel gates."""
    _assert_same_greedy(_vllm_runs([tp_checkpoint], tp=2)[str(tp_checkpoint)], _spear_greedy(tp_checkpoint))


def test_tensor_parallel_3_default_model(checkpoints, spear_runs):
    """The default model's 9 heads and 3 kv heads split over 3 ranks (sharing the 2 cores here)."""
    _assert_same_greedy(_vllm_runs([checkpoints["w4-gated"]], tp=3)[str(checkpoints["w4-gated"])],
                        spear_runs["w4-gated"])
