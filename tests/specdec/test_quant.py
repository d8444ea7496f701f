"""Quantized target formats: close to the layer they replace, every row independent of the rows it is fed with
(what keeps batched verification equal to one-by-one decoding), and speculation lossless against them."""

import pytest
import torch

from specdec import quant_layers
from specdec.build import build_engine
from specdec.engine import GenerationConfig, collect
from specdec.quant import TARGET_QUANTS, quantize_linears
from specdec.quant_cache import quantized_cache_path
from specdec.quant_fuse import fused_layer
from specdec.quant_layers import (
    FbgemmW8A8Linear,
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    OneDNNW8A8Linear,
    RowW8A8LinearBase,
    cpu_has,
    int8_rows,
)
from specdec.runner import BatchRunner
from tests.support.engine import cpu_only

LAYERS = {
    "int8": Int8WeightOnlyLinear,
    "w8a8": OneDNNW8A8Linear,
    "w8a8-fbgemm": FbgemmW8A8Linear,
    "int4": Int4WeightOnlyLinear,
}
QUANTS = [q for q in TARGET_QUANTS if q != "none"]
KERNELS = list(LAYERS)  # both w8a8 kernels: the engine picks one by the CPU (quant_layers.w8a8_layer)


def _linear(dtype: torch.dtype, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(256, 96, bias=bias).to(dtype)


@pytest.mark.parametrize("quant", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_is_close_to_the_original(quant, dtype):
    linear = _linear(dtype)
    x = torch.randn(7, 256).to(dtype)
    want = linear(x).detach().float()
    got = LAYERS[quant](linear)(x)
    assert got.dtype == dtype and got.shape == want.shape
    # int4 in groups of 32 keeps ~5% relative error on random weights, int8 well under 2%
    limit = 0.1 if quant == "int4" else 0.02
    assert float((got.float() - want).norm() / want.norm()) < limit


@pytest.mark.parametrize("quant", KERNELS)
def test_a_rows_output_does_not_depend_on_the_other_rows(quant):
    layer = LAYERS[quant](_linear(torch.bfloat16))
    x = torch.randn(17, 256).bfloat16()
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    for rows in (2, 5, 9, 17):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows
    # 3-D input (batch, sequence, features), as the model feeds it
    assert torch.equal(layer(x[None, :5]), alone[None, :5])


@pytest.mark.parametrize("layer_type", [OneDNNW8A8Linear, FbgemmW8A8Linear])
def test_w8a8_row_scale_is_per_row(layer_type):
    """The property that per-tensor dynamic int8 lacks: one large row does not coarsen another row's steps."""
    layer = layer_type(_linear(torch.float32, bias=False))
    x = torch.randn(2, 256)
    big = x.clone()
    big[1] *= 1000
    assert torch.equal(layer(x)[0], layer(big)[0])


@pytest.mark.skipif(not cpu_has("avx512_vnni"), reason="fbgemm keeps 8-bit activations only with AVX-512 VNNI")
def test_fbgemm_with_vnni_computes_what_onednn_computes_bit_for_bit():
    """With VNNI both w8a8 kernels quantize a row alike (8 bits, zero point 128), so a target's Linear layers give
    the same values on a CPU with AMX (oneDNN) and on one without (fbgemm): heads trained on one hold on the other."""
    linear = _linear(torch.float32)
    fbgemm, onednn = FbgemmW8A8Linear(linear), OneDNNW8A8Linear(linear)
    assert fbgemm.eight_bits
    x = torch.randn(9, 256) * torch.logspace(-3, 3, 9)[:, None]
    # a row whose scale is 1, with a value a float step below 37.5: rounded after a zero point of 128 is added in
    # float32 (fbgemm's own quantization) it would become 38, not 37
    x[0, :2] = torch.tensor([127.0, torch.nextafter(torch.tensor(37.5), torch.tensor(0.0))])
    x[0, 2:] = x[0, 2:].clamp(-100, 100)
    assert torch.equal(fbgemm(x), onednn(x))
    assert torch.equal(fbgemm(x[None, 2:7]), onednn(x[None, 2:7]))


@pytest.mark.skipif(not cpu_has("avx512_vnni"), reason="fbgemm keeps 8-bit activations only with AVX-512 VNNI")
def test_fbgemm_with_vnni_sums_exactly_where_16_bit_pair_sums_would_saturate():
    """Every input at its row's max and every weight at 127: 8-bit activations overflow the 16-bit pair sums of
    fbgemm's kernels without VNNI. Where the CPU reports VNNI, fbgemm must sum in int32 and give the exact product."""
    linear = torch.nn.Linear(256, 8, bias=False)
    with torch.no_grad():
        linear.weight.fill_(0.5)
    qweight, scale = int8_rows(linear.weight)
    assert int(qweight.min()) == 127
    layer = FbgemmW8A8Linear(linear)
    for sign in (1.0, -1.0):
        x = torch.full((2, 256), 3.0 * sign)
        exact = (x.double() @ (qweight.double() * scale.double()[:, None]).T).float()
        assert torch.allclose(layer(x), exact, rtol=1e-6), sign


def test_fbgemm_without_vnni_keeps_7_bit_activations_rows_independent(monkeypatch):
    """A CPU without AVX-512 VNNI (reduce_range): a row's output still does not depend on the others fed with it."""
    monkeypatch.setattr(quant_layers, "cpu_has", lambda flag: False)
    linear = _linear(torch.float32)
    layer = FbgemmW8A8Linear(linear)
    assert not layer.eight_bits
    x = torch.randn(17, 256)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(layer(x), alone)
    want = linear(x).detach()
    assert float((alone - want).norm() / want.norm()) < 0.02
    assert not torch.equal(alone, OneDNNW8A8Linear(linear)(x))  # 7 bits are not oneDNN's 8


def test_a_layer_packed_in_slices_gives_the_same_outputs_as_one_packed_whole(monkeypatch):
    """fbgemm packs a large layer (an LM head) in slices, as fast as its parts; every output column is computed on
    its own, so the slices must give the same values bit for bit, with the bias added once."""
    linear = torch.nn.Linear(256, 1000)
    whole = FbgemmW8A8Linear(linear)
    monkeypatch.setattr(FbgemmW8A8Linear, "PACK_ROWS", 300)
    sliced = FbgemmW8A8Linear(linear)
    assert [(start, end) for start, end, _ in sliced._packed] == [(0, 250), (250, 500), (500, 750), (750, 1000)]
    assert len(whole._packed) == 1 and sliced.packed_weight_bytes == whole.packed_weight_bytes
    x = torch.randn(2, 5, 256)
    assert torch.equal(sliced(x), whole(x))


@cpu_only
@pytest.mark.parametrize("quant", ["w8a8-fbgemm", "w8a8-onednn"])
def test_w8a8_fuses_the_layers_that_read_one_input_without_changing_a_value(tiny_engine, quant, monkeypatch):
    """q, k and v (and gate and up) run as one w8a8 layer: each keeps the outputs its own layer gives, bit for bit,
    and the runner's forward over the fused layers gives the logits of one that runs them one by one."""
    import copy

    import specdec.runner

    model = copy.deepcopy(tiny_engine.target.model)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    groups = {attn: ("q_proj", "k_proj", "v_proj"), mlp: ("gate_proj", "up_proj")}
    layer_type = FbgemmW8A8Linear if quant == "w8a8-fbgemm" else OneDNNW8A8Linear
    alone = {(m, n): layer_type(getattr(m, n)) for m, names in groups.items() for n in names}
    quantize_linears(model, quant)
    assert fused_layer(attn.q_proj, attn.k_proj, attn.v_proj) is not None
    assert fused_layer(mlp.gate_proj, mlp.up_proj) is not None
    assert fused_layer(attn.k_proj, attn.q_proj, attn.v_proj) is None and fused_layer(attn.q_proj) is None
    x = torch.randn(5, attn.q_proj.in_features)
    for (m, n), layer in alone.items():
        assert torch.equal(getattr(m, n)(x), layer(x)), n
    fused = BatchRunner(model, torch.device("cpu"), exact_rows=True)
    monkeypatch.setattr(specdec.runner, "fused_layer", lambda *layers: None)
    one_by_one = BatchRunner(model, torch.device("cpu"), exact_rows=True)
    assert fused.fused and not one_by_one.fused
    tokens = list(range(40, 60))
    assert torch.equal(fused.new_cache().extend(tokens, n_logits=5), one_by_one.new_cache().extend(tokens, n_logits=5))


def test_a_fused_group_keeps_each_layers_bias_or_its_lack():
    from specdec.quant import _w8a8_rows

    torch.manual_seed(0)
    block = torch.nn.Module()
    block.q_proj, block.k_proj, block.v_proj = (torch.nn.Linear(64, n, bias=n == 32) for n in (32, 16, 16))
    alone = {name: FbgemmW8A8Linear(getattr(block, name)) for name in ("q_proj", "k_proj", "v_proj")}
    _w8a8_rows(block, FbgemmW8A8Linear, None, None)
    assert fused_layer(block.q_proj, block.k_proj, block.v_proj) is not None
    x = torch.randn(3, 64)
    for name, layer in alone.items():
        assert torch.equal(getattr(block, name)(x), layer(x)), name


def test_unknown_format_is_refused(tiny_engine):
    with pytest.raises(ValueError, match="--target-quant"):
        quantize_linears(tiny_engine.target.model, "fp8")


@cpu_only
@pytest.mark.parametrize("quant", QUANTS)
def test_speculation_is_lossless_against_the_quantized_target(tiny_engine, quant):
    engine, target = build_engine(tiny_engine.spec_with(target_quant=quant, k="4"))
    engine.auto_off = False
    assert not any(type(m) is torch.nn.Linear for m in target.model.model.layers.modules())  # really quantized
    for text in ["hello there", "tell me a story about a cat", "a b a b a b a b"]:
        ids = target.tokenizer.chat_ids([{"role": "user", "content": text}])
        base, _ = collect(engine.stream(ids, GenerationConfig(40, speculate=False)))
        spec, _ = collect(engine.stream(ids, GenerationConfig(40)))
        assert spec == base, text


@cpu_only
@pytest.mark.parametrize("quant", QUANTS)
def test_a_verified_token_gets_the_logits_it_gets_decoded_alone(tiny_engine, quant):
    """Bit for bit: with the quantized target and row attention, a forward over several new tokens gives each the
    logits that feeding it alone gives (what makes greedy speculation equal target-only, not merely close)."""
    engine, _ = build_engine(tiny_engine.spec_with(target_quant=quant, draft="none"))
    tokens = list(range(40, 70))
    batched = engine.runner.new_cache()
    batched.extend(tokens[:20])
    together = batched.extend(tokens, n_logits=10)
    alone = engine.runner.new_cache()
    alone.extend(tokens[:20])
    one_by_one = torch.cat([alone.extend(tokens[: 21 + i])[-1:] for i in range(10)])
    assert torch.equal(together, one_by_one)


def test_smoothing_keeps_the_float_function_and_evens_out_channels():
    """SmoothQuant moves range from down_proj's input channels into its weights: the float model computes the same
    logits, and the input's channel peaks come closer together (what per-token int8 needs)."""
    from specdec.models import build_tiny_random
    from specdec.quant_smooth import smooth_mlp_inputs

    model = build_tiny_random(None)
    ids = torch.tensor([list(range(30, 90))])
    peaks = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_pre_hook(
        lambda m, args: peaks.append(args[0].abs().reshape(-1, args[0].shape[-1]).amax(0))
    )
    with torch.no_grad():
        before = model(input_ids=ids).logits
        smooth_mlp_inputs(model, ids)
        after = model(input_ids=ids).logits
    hook.remove()
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    spread = [float(p.max() / p.mean()) for p in peaks]
    assert spread[-1] < spread[0]  # peaks: before, during calibration (unchanged), after


@cpu_only
@pytest.mark.parametrize("quant", ["w8a8-fbgemm", "w8a8-onednn"])
def test_w8a8_read_from_its_cache_is_the_model_quantized_afresh(tiny_engine, tmp_path, quant):
    """The app's warm start reads the target's int8 weights from a file: the model must be the very same."""
    import copy

    cache = tmp_path / "target.safetensors"
    calibration = torch.arange(3, 40)[None]
    ids = torch.tensor([[5, 9, 2, 7, 1, 3, 8]])
    logits = []
    for use_cache in (False, True, True):  # afresh without a file; afresh writing it; read from it
        model = copy.deepcopy(tiny_engine.target.model)
        quantize_linears(model, quant, calibration, cache if use_cache else None)
        with torch.inference_mode():
            logits.append(model(input_ids=ids).logits)
    assert cache.exists()
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[1], logits[2])
    smoothed_differently = copy.deepcopy(tiny_engine.target.model)
    quantize_linears(smoothed_differently, quant, None, tmp_path / "other.safetensors")
    with torch.inference_mode():
        assert not torch.equal(smoothed_differently(input_ids=ids).logits, logits[2])  # the comparison can fail


@cpu_only
def test_a_cache_file_packed_early_is_taken_only_by_the_model_it_belongs_to(tiny_engine, tmp_path, monkeypatch):
    """The app packs the cache file it guesses while the model loads (early_packing.start). The load takes those layers
    when its own key names that file, and packs its own file afresh when the guess was another."""
    import copy
    import os

    from specdec.quant_cache import early_packing

    monkeypatch.setenv("SPECVOICE_CACHE", str(tmp_path))
    cache = tmp_path / "quantized" / "tiny-w8a8-float32-0123456789abcdef.safetensors"
    other = cache.with_name("tiny-w8a8-float32-fedcba9876543210.safetensors")
    ids, calibration = torch.tensor([[5, 9, 2, 7, 1, 3, 8]]), torch.arange(3, 40)[None]

    def quantized(path, smoothed=True):
        model = copy.deepcopy(tiny_engine.target.model)
        quantize_linears(model, "w8a8", calibration if smoothed else None, path)
        with torch.inference_mode():
            return model, model(input_ids=ids).logits

    _, want = quantized(cache)  # writes the file
    _, want_other = quantized(other, smoothed=False)  # another file for the same name, smoothed otherwise
    assert not torch.equal(want, want_other)
    os.utime(other, (0, 0))
    assert early_packing.start("tiny", "w8a8", "float32") == cache  # the newest file of that name and format
    assert early_packing.start("tiny", "w8a8", "float32") is None  # already packing
    early_packing.wait()  # what build_engines does before it measures the drafters' memory
    assert early_packing._pending[cache].done()  # finished, and still there to take
    packed = list(early_packing._pending[cache].result().values())  # held: ids stay theirs
    early = {id(layer) for layer in packed}
    model, got = quantized(cache)
    used = {id(m) for m in model.modules() if isinstance(m, RowW8A8LinearBase)}
    assert used == early and torch.equal(got, want)
    assert not early_packing._pending
    os.utime(other, (0, 0))
    assert early_packing.start("tiny", "w8a8", "float32") == cache  # a wrong guess: the model reads `other`
    packed = list(early_packing._pending[cache].result().values())  # held: ids stay theirs
    early = {id(layer) for layer in packed}
    model, got = quantized(other)
    used = {id(m) for m in model.modules() if isinstance(m, RowW8A8LinearBase)}
    assert not used & early and torch.equal(got, want_other)
    assert not early_packing._pending  # the wrong guess's layers dropped


@cpu_only
def test_a_cache_file_names_the_dtype_so_another_dtypes_file_is_never_the_guess(tiny_engine, tmp_path, monkeypatch):
    """The app loads the target in bfloat16, the real-model tests in float32: each start guesses its own file, not the
    one another dtype used last."""
    import copy
    import os
    import shutil

    from specdec import quant_cache

    monkeypatch.setenv("SPECVOICE_CACHE", str(tmp_path))
    monkeypatch.setattr(quant_cache, "CACHED_FROM_PARAMS", 0)
    model = copy.deepcopy(tiny_engine.target.model)
    path = quantized_cache_path(model, "w8a8", "tiny")
    bf16_path = quantized_cache_path(copy.deepcopy(model).to(torch.bfloat16), "w8a8", "tiny")
    assert path is not None and bf16_path is not None
    assert "-float32-" in path.name and "-bfloat16-" in bf16_path.name
    quantize_linears(model, "w8a8", torch.arange(3, 40)[None], path)
    shutil.copy(path, bf16_path)
    os.utime(path, (0, 0))  # the bfloat16 file was used last
    assert quant_cache.early_packing.start("tiny", "w8a8", "float32") == path
    assert quant_cache.early_packing.take(path) is not None


def test_only_a_large_model_gets_a_quantized_cache_file(tiny_engine):
    assert quantized_cache_path(tiny_engine.target.model, "w8a8", "tiny") is None


def test_the_cache_key_names_the_w8a8_layers_as_before_they_were_renamed(monkeypatch):
    """The layer's name goes into the cache file's key: a class renamed must not rename the file, or every user
    would quantize the target again."""
    from specdec.quant_cache import key_layer_name

    monkeypatch.setattr(quant_layers, "cpu_has_amx", lambda: True)
    assert key_layer_name("w8a8") == "Int8RowLinear"
    monkeypatch.setattr(quant_layers, "cpu_has_amx", lambda: False)
    assert key_layer_name("w8a8") == "Int8RowLinearFbgemm"
    assert key_layer_name("w8a8-onednn") == "w8a8-onednn" and key_layer_name("w8a8-fbgemm") == "w8a8-fbgemm"
