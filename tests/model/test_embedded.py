"""The embedded Qwen2.5-Coder-0.5B target: file checks (fast) and losslessness on real prompts (slow)."""

from __future__ import annotations

import pytest
import torch
from scripted import ScriptedDrafter, branching, garbage, oracle

from benchmarks.datasets import dev_set, read_jsonl
from toolspec_core.drafters.methods import RequestInfo, make_method
from toolspec_core.engine.budget import CostModel
from toolspec_core.engine.loop import DecodeConfig, generate, prefill
from toolspec_core.model import embedded
from toolspec_core.model.embedded import ModelFileError, assemble_gguf, verify_gguf
from toolspec_core.model.prompting import render_prompt
from toolspec_core.model.target import load_target


def test_wrong_hash_file_is_refused(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(ModelFileError, match="sha256"):
        verify_gguf(bad)


def test_corrupt_cached_gguf_is_refused_not_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("TOOLSPEC_CACHE", str(tmp_path))
    dest = tmp_path / "embedded" / embedded.GGUF_NAME
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"not a model")
    with pytest.raises(ModelFileError, match="corrupt"):
        assemble_gguf()


def test_missing_or_broken_model_dir_gives_clear_error(tmp_path):
    with pytest.raises(ModelFileError, match="config.json"):
        load_target(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelFileError):
        load_target(tmp_path)


def test_missing_model_file(tmp_path):
    with pytest.raises(ModelFileError, match="does not exist"):
        verify_gguf(tmp_path / "nope.gguf")


# ---------------------------------------------------------------- slow: real weights


def _items(bench: str, n: int, step: int = 1):
    return read_jsonl(dev_set(bench))[::step][:n]


@pytest.fixture(scope="module")
def qwen():
    torch.manual_seed(0)
    return load_target()


@pytest.mark.slow
def test_embedded_greedy_equals_hf_generate_for_oracle_garbage_branching(qwen):
    for it in _items("api_bank", 1, 7) + _items("bfcl_v3", 1, 5) + _items("toolalpaca", 1, 3):
        prompt = render_prompt(qwen.tokenizer, it["messages"], it["tools"])
        n = 40
        with torch.inference_mode():
            ref = qwen.model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=n,
                do_sample=False,
            )[0, len(prompt) :].tolist()
        eos = set(qwen.eos_ids)
        ref = ref[: next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))]
        pool = qwen.block_pool(2 * len(prompt) + 256)
        prefill(qwen, prompt, pool)  # once: each decode finds the prompt's blocks in the prefix cache
        for make in (oracle, garbage, branching):
            res = generate(qwen, prompt, ScriptedDrafter(make(ref)), DecodeConfig(max_new_tokens=n), pool=pool)
            assert res.tokens == ref, (it["id"], make.__name__)


@pytest.mark.slow
def test_embedded_toolspec_greedy_identical_on_30_real_prompts(qwen):
    """Schema + prompt lookup (+ online retrieval) drafting never changes the greedy output."""
    items = _items("api_bank", 12, 25) + _items("bfcl_v3", 10, 97) + _items("toolalpaca", 8, 11)
    assert len(items) == 30
    method = make_method("toolspec", qwen.tokenizer)
    cost = CostModel.cpu_reference()
    cfg = DecodeConfig(max_new_tokens=96)
    accepted = 0
    eos = set(qwen.eos_ids)
    for it in items:
        prompt = render_prompt(qwen.tokenizer, it["messages"], it["tools"])
        pool = qwen.block_pool(2 * len(prompt) + 2 * (cfg.max_new_tokens + 64))
        pre = prefill(qwen, prompt, pool)  # once: each decode finds the prompt's blocks in the prefix cache
        plain = generate(qwen, prompt, None, cfg, pool=pool)
        req = RequestInfo(prompt, it["tools"], embedding=pre.hidden)
        drafter = method.drafter(req)
        spec = generate(qwen, prompt, drafter, cfg, cost, pool=pool)
        assert spec.tokens == plain.tokens, it["id"]
        # the incrementally decoded text is the full decode; the FSM read it as the tokenizer spells it
        ids = plain.tokens[:-1] if plain.tokens[-1] in eos else plain.tokens
        assert spec.text == plain.text == qwen.tokenizer.decode(ids, skip_special_tokens=False), it["id"]
        fed = qwen.tokenizer.decode(spec.tokens[: drafter._n_fed], skip_special_tokens=True)
        assert drafter.tracker.text == fed and spec.text.startswith(fed), it["id"]
        method.observe(req, spec.tokens, spec.text)
        accepted += sum(spec.stats.accepted)
    assert accepted > 0


@pytest.mark.slow
def test_embedded_batch_of_4_equals_single_stream_greedy_on_20_real_prompts(qwen):
    """20 real dev prompts (of the 30 above) decoded four at a time -- ToolSpec, suffix and plain
    sequences mixed, one batch-wide budget -- equal single-stream plain greedy token for token."""
    from toolspec_core.engine.scheduler import BatchLimits, Scheduler
    from toolspec_core.engine.sequence import Sequence

    items = _items("api_bank", 8, 25) + _items("bfcl_v3", 7, 97) + _items("toolalpaca", 5, 11)
    assert len(items) == 20
    cfg = DecodeConfig(max_new_tokens=32)  # the calls' opening, names and first arguments; keeps the tier's time
    methods = {name: make_method(name, qwen.tokenizer) for name in ("toolspec", "suffix")}
    cost = CostModel.cpu_reference()
    for start in range(0, len(items), 4):
        group = items[start : start + 4]
        prompts = [render_prompt(qwen.tokenizer, it["messages"], it["tools"]) for it in group]
        pool = qwen.block_pool(2 * sum(len(p) for p in prompts) + 8 * (cfg.max_new_tokens + 80))
        pres = [prefill(qwen, p, pool) for p in prompts]  # once: every decode finds the prompts' blocks
        plain = [generate(qwen, p, None, cfg, pool=pool).tokens for p in prompts]
        sched = Scheduler(qwen, cost, BatchLimits(max_running=4), pool)
        seqs = []
        for i, (it, p, pre) in enumerate(zip(group, prompts, pres)):
            name = ("toolspec", "suffix", "toolspec", None)[(start // 4 + i) % 4]
            drafter = methods[name].drafter(RequestInfo(p, it["tools"], embedding=pre.hidden)) if name else None
            seqs.append(sched.add(Sequence(qwen, p, drafter, cfg)))
        sched.run()
        assert max(s.sequences for s in sched.steps) == len(group)
        for it, seq, want in zip(group, seqs, plain):
            assert seq.result.tokens == want, it["id"]
        for name, method in methods.items():
            for it, p, seq in zip(group, prompts, seqs):
                method.observe(RequestInfo(p, it["tools"]), seq.result.tokens, seq.result.text)


@pytest.mark.slow
def test_replay_recording_is_this_model_s_plain_greedy(qwen):
    """The committed replay recording (benchmarks/replay.py) is what the embedded model writes:
    its shortest recorded prompt's first tokens, decoded again."""
    from benchmarks.replay import RECORDING, load_recording

    rows = load_recording(RECORDING, qwen.tokenizer)
    r = min(rows, key=lambda x: x["prompt_len"])
    res = generate(qwen, r["prompt_ids"], None, DecodeConfig(max_new_tokens=8))
    assert res.tokens == r["tokens"][:8]


@pytest.mark.slow
def test_embedded_bfloat16_toolspec_greedy_equals_plain_greedy():
    """In bfloat16 on the CPU (``dtype: bfloat16``, or ``auto`` where the CPU computes it), greedy
    ToolSpec writes plain greedy's tokens: a tool call drafted many tokens a step, and a text
    answer whose verify steps' rows rounded differently from one-row steps until one-row linears
    ran as GEMMs (``tune_reduced_linears``) and decode and tree rows through the fixed-order
    attention (``rows_attention``); and a long tool prompt of the bf16 load test (unique prefix)
    whose answer left plain greedy's at token 90 with SDPA's float32 attention."""
    target = load_target(dtype=torch.bfloat16)
    assert target.dtype == torch.bfloat16
    wanted = {"simple_1", "api_bank-L1-DocumentQA-level-1-3-0"}
    items = [it for b in ("bfcl_v3", "api_bank") for it in read_jsonl(dev_set(b)) if it["id"] in wanted]
    assert len(items) == 2
    method = make_method("toolspec", target.tokenizer)
    cfg = DecodeConfig(max_new_tokens=40)
    accepted = 0
    for it in items:
        prompt = render_prompt(target.tokenizer, it["messages"], it["tools"])
        pool = target.block_pool(2 * len(prompt) + 2 * (cfg.max_new_tokens + 64))
        pre = prefill(target, prompt, pool)
        plain = generate(target, prompt, None, cfg, pool=pool)
        spec = generate(
            target,
            prompt,
            method.drafter(RequestInfo(prompt, it["tools"], embedding=pre.hidden)),
            cfg,
            CostModel.cpu_reference(),
            pool=pool,
        )
        assert spec.tokens == plain.tokens, it["id"]
        accepted += sum(spec.stats.accepted)
    assert accepted > 0
    # the load test's request: each generate prefills the prompt into a pool of its own, as two
    # servers do when nothing is cached
    from benchmarks.loadtest.workloads import request_nonce, with_nonce

    salt = "0:loadtest-unique-bf16-long-fresh-c1-c8-n48-cpu-epyc-5f9285b"
    (it,) = [it for it in read_jsonl(dev_set("toolalpaca")) if it["id"] == "toolalpaca-simulated-8-9"]
    it = with_nonce(it, request_nonce(salt, 0, 5, it["id"]))
    prompt = render_prompt(target.tokenizer, it["messages"], it["tools"])
    cfg = DecodeConfig(max_new_tokens=100)

    def pool():
        return target.block_pool(2 * len(prompt) + 2 * (cfg.max_new_tokens + 64))

    pre = prefill(target, prompt, pool())
    plain = generate(target, prompt, None, cfg, pool=pool())
    drafter = method.drafter(RequestInfo(prompt, it["tools"], embedding=pre.hidden))
    spec = generate(target, prompt, drafter, cfg, CostModel.cpu_reference(), pool=pool())
    assert len(prompt) > 1000 and sum(spec.stats.accepted) > 0
    assert spec.tokens == plain.tokens


@pytest.mark.slow
def test_embedded_bfloat16_prompt_reads_alike_however_a_server_cuts_it():
    """A bfloat16 model reads a prompt into the same bits in any chunks: alone in 512-row chunks,
    in 200- or 97-row chunks, or sharing each step's prompt rows with another waiting prompt (what
    a loaded server does; the long load-test prompt whose bf16 answers parted from plain greedy's
    at c = 8 when prompt chunks took SDPA). Every row goes through the fixed-order attention and the
    linears give a row the same bits whatever rows share the call, so every prompt token's
    last-layer state is equal bit for bit."""
    from benchmarks.loadtest.workloads import request_nonce, with_nonce
    from toolspec_core.engine.scheduler import BatchLimits, run_batch
    from toolspec_core.engine.sequence import Sequence

    target = load_target(dtype=torch.bfloat16)
    salt = "0:loadtest-unique-bf16-long-fresh-c1-c8-n48-cpu-epyc-5f9285b"
    (it,) = [it for it in read_jsonl(dev_set("toolalpaca")) if it["id"] == "toolalpaca-simulated-8-9"]
    it = with_nonce(it, request_nonce(salt, 0, 5, it["id"]))
    prompt = render_prompt(target.tokenizer, it["messages"], it["tools"])
    (other,) = [it for it in read_jsonl(dev_set("bfcl_v3")) if it["id"] == "simple_1"]
    first = render_prompt(target.tokenizer, other["messages"], other["tools"])
    assert len(prompt) > 1000 and 50 < len(first) < 512

    def read(chunk: int, beside: list[int] | None = None) -> torch.Tensor:
        """Every token's last-layer state [n, H] of ``prompt``, read after ``beside`` in one batch."""
        prompts = [beside, prompt] if beside else [prompt]
        limits = BatchLimits(max_running=2, prefill_chunk=chunk)
        seqs = [Sequence(target, list(p), None, DecodeConfig(max_new_tokens=1), prompt_states=True) for p in prompts]
        pool = target.block_pool(sum(limits.rows_for(len(p), 1) for p in prompts))
        run_batch(target, seqs, None, limits, pool)
        return torch.cat(seqs[-1].states)

    alone = read(512)
    assert alone.shape[0] == len(prompt) and alone.dtype == torch.bfloat16
    for chunk, beside in ((200, None), (97, None), (512, first), (300, first)):
        assert torch.equal(read(chunk, beside), alone), (chunk, beside is not None)
