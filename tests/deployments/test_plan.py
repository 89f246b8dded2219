"""The capacity plan (deployments/plan.py): its figures against the arithmetic done here by hand for
Qwen2.5-72B and Qwen2.5-0.5B, the refusals, ``toolspec plan`` and ``build_app``'s check."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from deployments.cli import main as toolspec
from deployments.config import ServeAppConfig
from deployments.plan import WORKSPACE_RESERVE, check_plan, make_plan, model_shape, parse_memory
from toolspec_core.model.shapes import SHAPES

GiB = 2**30
# gpu_memory 80GiB x kv_memory_fraction 0.9 = 72 GiB usable, 2 GiB of it the reserve
USABLE_80GIB = 72 * GiB
assert WORKSPACE_RESERVE == 2 * GiB


@pytest.mark.parametrize(
    "text,size",
    [
        ("80GiB", 80 * 2**30),
        ("80Gi", 80 * 2**30),
        ("141GB", 141 * 10**9),
        ("141G", 141 * 10**9),
        ("1.5TiB", 3 * 2**39),
        ("512MiB", 2**29),
        ("85899345920", 85899345920),
        (85899345920, 85899345920),
    ],
)
def test_parse_memory(text, size):
    assert parse_memory(text) == size


@pytest.mark.parametrize("text", ["eighty", "80 GiBs", "", "-1GiB", "0", 0, "80PB"])
def test_parse_memory_refuses(text):
    with pytest.raises(ValueError):
        parse_memory(text)


def test_config_refuses_an_unreadable_gpu_memory():
    assert ServeAppConfig(gpu_memory="80GiB").gpu_memory == "80GiB"
    with pytest.raises(ValidationError, match="memory size"):
        ServeAppConfig(gpu_memory="80 gigs")


def test_qwen72b_tp8_bf16_on_80gib():
    """Qwen2.5-72B: 80 layers, hidden 8192, 64 heads of 128, 8 KV heads, intermediate 29568,
    vocab 152064, untied; TP 8 gives a rank 8 heads, 1 KV head and 3696 intermediate rows."""
    plan = make_plan(model_shape("qwen2.5-72b"), 8, "bfloat16", parse_memory("80GiB"), model="qwen2.5-72b")
    q = 8192 * (8 * 128)  # this rank's q columns, and o's rows
    kv = 2 * 8192 * (1 * 128)  # k and v
    bias = 8 * 128 + 2 * 128  # q, k, v
    mlp = 3 * 8192 * (29568 // 8)  # gate, up, down
    per_layer = q + kv + q + bias + mlp
    assert per_layer == 109_708_544
    # the linears, and 152064 / 8 = 19008 rows of embed_tokens and of lm_head
    assert plan.split_params == 80 * per_layer + 2 * 19008 * 8192 == 8_776_683_520 + 311_427_072 == 9_088_110_592
    # two norms a layer and the final one
    assert plan.replicated_params == (2 * 80 + 1) * 8192 == 1_318_912
    assert plan.params == 72_706_203_648  # the model card's 72.7B
    assert plan.weights_per_gpu == 2 * (9_088_110_592 + 1_318_912) == 18_178_859_008  # 16.93 GiB
    assert plan.usable_memory == USABLE_80GIB
    assert plan.kv_memory == USABLE_80GIB - 18_178_859_008 - 2 * GiB == 56_983_068_672
    assert plan.kv_bytes_per_token == 2 * 80 * (8 // 8) * 128 * 2 == 40_960
    blocks = 56_983_068_672 // (40_960 * 16)
    assert blocks == 86_949
    assert plan.pool_tokens == 16 * blocks == 1_391_184
    assert plan.context == plan.context_tokens == 32768  # max_position_embeddings
    assert plan.concurrency == blocks // (32768 // 16) == 42
    at_8k = make_plan(model_shape("qwen2.5-72b"), 8, "bfloat16", 80 * GiB, context=8192)
    assert at_8k.concurrency == blocks // (8192 // 16) == 169


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen05b_fp32(tp):
    """Qwen2.5-0.5B: 24 layers, hidden 896, 14 heads of 64, 2 KV heads, intermediate 4864,
    vocab 151936, tied embeddings: the in-process replica (TP 1) counts lm_head once, as it is
    embed_tokens; at TP 2 a rank holds 151936 / 2 = 75968 rows of embed_tokens and, a copy of its
    own, the same rows of lm_head -- as many as the whole tied table."""
    plan = make_plan(model_shape("qwen2.5-0.5b"), tp, "float32", parse_memory("80GiB"))
    heads, kv_heads, inter = 14 // tp, 2 // tp, 4864 // tp
    per_layer = 896 * heads * 64 * 2 + 2 * 896 * kv_heads * 64 + (heads + 2 * kv_heads) * 64 + 3 * 896 * inter
    assert per_layer == {1: 14_910_592, 2: 7_455_296}[tp]
    vocab_rows = {1: 151936, 2: 2 * 75968}[tp]
    assert plan.split_params == 24 * per_layer + vocab_rows * 896 == 24 * per_layer + 136_134_656
    assert plan.replicated_params == (2 * 24 + 1) * 896 == 43_904  # the norms
    assert plan.params == 24 * 14_910_592 + 136_134_656 + 43_904 == 494_032_768  # the model card's 0.49B
    weights = 4 * (24 * per_layer + 136_134_656 + 43_904)
    assert plan.weights_per_gpu == weights == {1: 1_976_131_072, 2: 1_260_422_656}[tp]
    per_token = 2 * 24 * kv_heads * 64 * 4
    assert plan.kv_bytes_per_token == per_token == {1: 24_576, 2: 12_288}[tp]
    blocks = (USABLE_80GIB - weights - 2 * GiB) // (per_token * 16)
    assert plan.pool_tokens == 16 * blocks == {1: 2_977_936, 2: 6_014_112}[tp]
    assert plan.concurrency == blocks // 2048 == {1: 90, 2: 183}[tp]


def test_embedded_tp2_fp32_weights_match_the_workers():
    """The embedded checkpoint (untied, vocab 151936, hidden 896) at TP 2 in fp32: the plan's
    weights per GPU are what a TP worker measured it holds (benchmarks/runs/tp/tp2-embedded-cpu.json,
    "workers": 1,260,422,656 B), its own rows of embed_tokens and of lm_head included."""
    from toolspec_core.model.embedded import embedded_model_dir

    config = embedded_model_dir() / "config.json"
    if not config.is_file():
        pytest.skip("no embedded model (scripts/setup.sh converts it)")
    shape = model_shape(str(config))
    assert shape["tie_word_embeddings"] is False and shape["vocab_size"] == 151936
    plan = make_plan(shape, 2, "float32", parse_memory("80GiB"))
    assert plan.weights_per_gpu == 4 * (24 * 7_455_296 + 2 * 75968 * 896 + (2 * 24 + 1) * 896) == 1_260_422_656


def test_tp_must_divide_the_heads():
    with pytest.raises(ValueError, match="does not divide num_key_value_heads 8"):
        make_plan(model_shape("qwen2.5-72b"), 16, "bfloat16", 80 * GiB)
    with pytest.raises(ValueError, match="does not divide num_attention_heads 64 and num_key_value_heads 8"):
        make_plan(model_shape("qwen2.5-72b"), 3, "bfloat16", 80 * GiB)
    with pytest.raises(ValueError, match="num_attention_heads 14 and num_key_value_heads 2"):
        make_plan(model_shape("qwen2.5-0.5b"), 4, "float32", 80 * GiB)


@pytest.fixture()
def qwen72b_dir(tmp_path):
    """A model directory holding only Qwen2.5-72B-Instruct's config.json (its real keys)."""
    config = dict(SHAPES["qwen2.5-72b"], model_type="qwen2", architectures=["Qwen2ForCausalLM"], rms_norm_eps=1e-6)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_model_shape_reads_a_directory_or_its_config(qwen72b_dir):
    assert model_shape(str(qwen72b_dir))["num_key_value_heads"] == 8
    assert model_shape(str(qwen72b_dir / "config.json"))["intermediate_size"] == 29568
    with pytest.raises(FileNotFoundError, match="known shape"):
        model_shape(str(qwen72b_dir / "missing"))


def test_check_plan_refuses_72b_on_one_80gib_gpu(qwen72b_dir):
    cfg = ServeAppConfig(model=str(qwen72b_dir), dtype="bfloat16", device="cuda", gpu_memory="80GiB")
    with pytest.raises(ValueError) as err:
        check_plan(cfg)
    msg = str(err.value)
    # weights per GPU 145,412,407,296 B = 2 x 72,706,203,648; 72 GiB usable; a 32,768-token context of 327,680 B a token
    for figure in ("does not fit", "145,412,407,296 B (135.43 GiB)", "77,309,411,328 B (72.00 GiB)", "327,680 B"):
        assert figure in msg
    assert check_plan(cfg.model_copy(update={"tensor_parallel_size": 8})).concurrency == 42
    assert check_plan(cfg.model_copy(update={"gpu_memory": None})) is None


def test_check_plan_context_is_plan_context_tokens(qwen72b_dir):
    cfg = ServeAppConfig(
        model=str(qwen72b_dir), dtype="bfloat16", tensor_parallel_size=8, gpu_memory="80GiB", plan_context_tokens=8192
    )
    assert check_plan(cfg).concurrency == 169
    # TP 2 on 80 GiB GPUs: 72 GiB usable less 2 x (36,352,442,368 + 1,318,912) B of weights (the
    # linears' half and 76032 rows each of embed_tokens and lm_head, and the norms) and the 2 GiB
    # reserve leaves 2,454,405,120 B: 936 blocks of 16 tokens x 163,840 B, one context of 8,192
    # tokens (512 blocks) and none of the full 32,768 (2,048 blocks)
    small = cfg.model_copy(update={"tensor_parallel_size": 2})
    per_layer = 2 * 8192 * (32 * 128) + 2 * 8192 * (4 * 128) + (32 + 2 * 4) * 128 + 3 * 8192 * (29568 // 2)
    assert 80 * per_layer + 2 * 76032 * 8192 == 35_106_734_080 + 1_245_708_288 == 36_352_442_368
    kv_memory = USABLE_80GIB - 2 * (36_352_442_368 + 1_318_912) - 2 * GiB
    assert check_plan(small).kv_memory == kv_memory == 2_454_405_120
    assert check_plan(small).pool_tokens == 16 * (kv_memory // (16 * 163_840)) == 16 * 936
    assert check_plan(small).concurrency == 936 // 512 == 1
    with pytest.raises(ValueError, match="one request of 32,768 tokens"):
        check_plan(small.model_copy(update={"plan_context_tokens": None}))


def test_build_app_refuses_what_does_not_fit(qwen72b_dir):
    from deployments.app import build_app

    with pytest.raises(ValueError, match="does not fit"):
        build_app({"model": str(qwen72b_dir), "dtype": "bfloat16", "gpu_memory": "80GiB", "tensor_parallel_size": 2})


def test_cli_prints_the_plan(capsys):
    assert (
        toolspec(["plan", "--model", "qwen2.5-72b", "--tp", "8", "--dtype", "bfloat16", "--gpu-memory", "80GiB"]) == 0
    )
    out = capsys.readouterr().out
    for figure in (
        "72,706,203,648",
        "18,178,859,008 B (16.93 GiB)",
        "40,960 B",
        "1,391,184 tokens",
        "42 request(s) at full context",
    ):
        assert figure in out
    assert (
        toolspec(
            ["plan", "--model", "qwen2.5-0.5b", "--tp", "2", "--dtype", "float32", "--gpu-memory", "80GiB", "--json"]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert (plan["weights_per_gpu"], plan["pool_tokens"], plan["concurrency"], plan["fits"]) == (
        1_260_422_656,
        6_014_112,
        183,
        True,
    )


def test_cli_refusals(capsys):
    assert toolspec(["plan", "--model", "qwen2.5-72b", "--tp", "1", "--gpu-memory", "80GiB"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert toolspec(["plan", "--model", "qwen2.5-72b", "--tp", "16", "--gpu-memory", "80GiB"]) == 2
    assert "num_key_value_heads 8" in capsys.readouterr().out
    assert toolspec(["plan", "--model", "no-such-model", "--gpu-memory", "80GiB"]) == 2
