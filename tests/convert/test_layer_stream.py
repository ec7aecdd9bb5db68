"""`--calib` layer by layer: the same moments as the whole model, one layer in memory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from conftest import EXAMPLE_MHA8, REPO, TRAIN_TXT, real_config
from tiny import random_model, save, scaled_config
from uptrain.convert.layers.layer import LayerGone
from uptrain.convert.layers.calibrate import Calibration

SMALL = dict(hidden_size=64, head_dim=8, num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=3,
             intermediate_size=32, vocab_size=512, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
# family -> (config builder): biases, partial rotary, key norms, scaled embeddings, fused qkv, sliding windows
FAMILIES = {
    "llama": lambda: AutoConfig.for_model("llama", **SMALL),
    "qwen2": lambda: scaled_config(json.loads(real_config("qwen2.5-7b").read_text()), layers=3, vocab=512),
    "mistral": lambda: scaled_config(json.loads(real_config("mistral-7b-v0.1").read_text()), layers=3, vocab=512,
                                     sliding_window=4),
    "phi": lambda: scaled_config(json.loads(real_config("phi-2").read_text()), layers=3, vocab=512, head_dim=10),
    "olmo2": lambda: scaled_config(json.loads(real_config("olmo-2-0425-1b").read_text()), layers=3, vocab=512),
    "stablelm": lambda: AutoConfig.for_model("stablelm", **SMALL, partial_rotary_factor=0.5, qk_layernorm=True,
                                             use_qkv_bias=True),
    "qwen3": lambda: AutoConfig.for_model("qwen3", **SMALL),
    "gemma": lambda: AutoConfig.for_model("gemma", **{**SMALL, "hidden_size": 48}),
    "gemma3_text": lambda: AutoConfig.for_model("gemma3_text", **{**SMALL, "hidden_size": 48, "sliding_window": 4,
                                                                  "layer_types": ["sliding_attention",
                                                                                  "full_attention",
                                                                                  "sliding_attention"]}),
    "phi3": lambda: AutoConfig.for_model("phi3", **SMALL),
}


def with_tokenizer(folder: Path) -> Path:
    """stories260K's tokenizer (512 tokens) beside a tiny model, so Calibration can tokenize text."""
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(EXAMPLE_MHA8 / f, folder / f)
    return folder


@torch.no_grad()
def reference_moments(folder: Path, text: Path, tokens: int) -> dict[str, torch.Tensor]:
    """The calibration as it was before streaming, written out here: the whole float32 model, one
    forward per calibration window, hooks on q_proj/qkv_proj summing [x; 1][x; 1]ᵀ in float64."""
    from uptrain.convert.layers.calibrate import WINDOW, calibration_sequences, read_calibration_texts

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    sums, counts = {}, {}

    def hook(prefix):
        def pre(_module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
            sums[prefix] = sums.get(prefix, 0) + x.T @ x
            counts[prefix] = counts.get(prefix, 0) + len(x)
        return pre
    for name, module in model.named_modules():
        for leaf in ("q_proj", "qkv_proj"):
            if name.endswith("." + leaf):
                module.register_forward_pre_hook(hook(name[: -len(leaf)]))
    window = min(WINDOW, model.config.max_position_embeddings)
    # the default windows (`calibration_sequences`, tested on their own in test_calib_windows.py)
    for ids in calibration_sequences(read_calibration_texts(text), tokenizer, tokens, window)[0]:
        model(input_ids=torch.tensor([ids]), use_cache=False)
    return {k: s / counts[k] for k, s in sums.items()}


def assert_same_moments(folder: Path, tokens: int, **calib) -> Calibration:
    expected = reference_moments(folder, TRAIN_TXT, tokens)
    calibration = Calibration(TRAIN_TXT, tokens, **calib).bind(folder)
    # asked last layer first: the stream runs every layer once and keeps the moments passed over
    for prefix in sorted(expected, key=lambda p: -int(p.split(".")[2])):
        torch.testing.assert_close(calibration.sigma(prefix), expected[prefix], rtol=1e-6, atol=1e-6)
    assert calibration.record["mode"] == "layer by layer", calibration.record
    return calibration


def test_stories260k_moments_equal_the_whole_model(one_torch_thread):
    calibration = assert_same_moments(EXAMPLE_MHA8, 1500)
    assert calibration.record["tokens_used"] == 1500 and calibration.record["layers_run"] == 5


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_moments_equal_the_whole_model(family, tmp_path, one_torch_thread):
    """Every family the converter supports, streamed, gives the whole model's moments: biases,
    partial rotary, key norms, Gemma's embedding scale, sliding-window layers, fused qkv_proj."""
    folder = with_tokenizer(save(random_model(FAMILIES[family]()), tmp_path / family))
    assert_same_moments(folder, 300)


def test_sharded_bf16_checkpoint_and_small_activation_limit(tmp_path, one_torch_thread):
    """Shards are read a layer at a time; over the activation limit the activations are kept in
    bfloat16 (the record says so), which changes the moments only at bfloat16 precision."""
    folder = with_tokenizer(save(random_model(FAMILIES["llama"](), dtype=torch.bfloat16), tmp_path / "m",
                                 max_shard_size="100KB"))
    assert len(list(folder.glob("*.safetensors"))) > 1
    expected = reference_moments(folder, TRAIN_TXT, 300)
    exact = Calibration(TRAIN_TXT, 300, activation_limit=300 * 64 * 4).bind(folder)
    narrow = Calibration(TRAIN_TXT, 300, activation_limit=300 * 64 * 4 - 1).bind(folder)
    for prefix, sigma in expected.items():
        torch.testing.assert_close(exact.sigma(prefix), sigma, rtol=1e-6, atol=1e-6)
        narrow_sigma = narrow.sigma(prefix)
        torch.testing.assert_close(narrow_sigma, sigma, rtol=0.05, atol=0.05)
        if prefix == "model.layers.2.self_attn.":
            assert not torch.equal(narrow_sigma, sigma)
    assert exact.record["activations"] == "float32" and narrow.record["activations"] == "bfloat16"


def test_a_layer_holds_the_attention_inputs_until_the_stream_moves_on(tmp_path, one_torch_thread):
    """For refinement: after sigma(layer), the layer's attention module and its inputs per
    sequence are there, and calling the attention on them reproduces the moments' inputs; once the
    stream runs the next layer, asking the old one for them is an error naming why, not None."""
    folder = EXAMPLE_MHA8
    calibration = Calibration(TRAIN_TXT, 600, keep="attention").bind(folder)
    sigma = calibration.sigma("model.layers.1.self_attn.")
    layer = calibration.layer("model.layers.1.self_attn.")
    assert layer.index == 1 and layer.state == "ran"
    with pytest.raises(LayerGone, match="layer 0 no longer holds .* moved on to layer 1"):
        calibration.layer("model.layers.0.self_attn.").recorded()
    recorded = layer.recorded()
    x = torch.cat(recorded.inputs).double()
    x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
    torch.testing.assert_close(x.T @ x / len(x), sigma, rtol=1e-9, atol=1e-9)
    # its recorded outputs (refinement's targets) are what the whole model's attention gives
    from uptrain.convert.layers.calibrate import calibration_sequences, read_calibration_texts
    from uptrain.convert.math.refine import capture

    sequences, _, _, _ = calibration_sequences(read_calibration_texts(TRAIN_TXT), AutoTokenizer.from_pretrained(folder),
                                               600, 512)
    whole = capture(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(),
                    [torch.tensor(x) for x in sequences], layers=[1])[1]
    assert len(whole.outputs) == len(recorded.outputs) == len(recorded.inputs)
    for mine, theirs, x, y in zip(recorded.outputs, whole.outputs, recorded.inputs, whole.inputs):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    module = layer.module
    calibration.sigma("model.layers.2.self_attn.")
    assert layer.state == "freed" and module.self_attn.q_proj.weight.is_meta and not recorded.inputs  # layer 1 freed
    for ask in (layer.recorded, lambda: layer.attention, lambda: layer.module, layer.moments):
        with pytest.raises(LayerGone, match="layer 1"):
            ask()


@pytest.mark.parametrize("keep", ["moments", "attention", "layer"])
def test_the_layer_just_run_keeps_only_what_the_conversion_uses(keep, one_torch_thread):
    """After sigma(layer): calibration alone frees the whole layer (the fit reads the checkpoint);
    refinement on the original inputs keeps the attention's inputs and recorded outputs (its targets)
    but none of the layer's weights (stories260K's attention is projections only: no norms); on the
    converted inputs the whole layer stays (it runs again). The moments are the same in every case,
    and what a layer did not keep is an error to ask for."""
    calibration = Calibration(TRAIN_TXT, 600, keep=keep).bind(EXAMPLE_MHA8)
    sigma = calibration.sigma("model.layers.1.self_attn.")
    layer = calibration.layer("model.layers.1.self_attn.")
    metas = [p.is_meta for p in layer.module.parameters()]
    assert all(metas) if keep != "layer" else not any(metas)
    sequences = len(calibration.windows()[0])
    if keep == "attention":
        recorded = layer.recorded()
        assert len(recorded.inputs) == len(recorded.outputs) == sequences
        for x, y in zip(recorded.inputs, recorded.outputs):
            assert y.shape == x.shape and y.dtype == torch.float32 and torch.isfinite(y).all()
    else:
        with pytest.raises(LayerGone, match=f"kept only {keep}"):
            layer.recorded()
    if keep == "layer":
        examples = layer.examples_on(calibration.first_inputs())  # layer 1 on layer 0's inputs: not its own
        assert len(examples.inputs) == len(examples.outputs) == sequences
    else:
        with pytest.raises(LayerGone, match=f"kept only {keep}"):
            layer.examples_on([])
    reference = Calibration(TRAIN_TXT, 600, keep="layer").bind(EXAMPLE_MHA8)
    torch.testing.assert_close(sigma, reference.sigma("model.layers.1.self_attn."), rtol=0, atol=0)


def test_users_of_one_stream_each_get_every_layer_and_the_stream_runs_once(one_torch_thread):
    """A sweep's K/V counts read one stream, each in its own thread: each user gets every layer's
    moments (equal to a one-user calibration's), the stream runs each layer once, and a layer is
    freed only when every user has moved past it (the slow user still finds its recordings)."""
    prefixes = [f"model.layers.{i}.self_attn." for i in range(5)]
    single = Calibration(TRAIN_TXT, 600).bind(EXAMPLE_MHA8)
    expected = [single.sigma(p) for p in prefixes]
    shared = Calibration(TRAIN_TXT, 600, keep="attention", users=3).bind(EXAMPLE_MHA8)
    got, errors = _run_users(shared, 3, prefixes, slow=2, delay=0.05)  # the slowest: the last
    assert not errors, errors
    assert shared.record["layers_run"] == 5 and shared.record["passes"] == 1
    for u in range(3):
        for mine, theirs in zip(got[u], expected):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


SLOW_USER_CASES = [(users, slow) for users in (2, 3, 4) for slow in range(users)]


@pytest.mark.parametrize(("users", "slow"), SLOW_USER_CASES, ids=[f"{u}users-slow{s}" for u, s in SLOW_USER_CASES])
def test_whichever_user_is_slow_finds_its_layer_still_there(users, slow, one_torch_thread):
    """Each user in turn is the slow one (not only the last, as above): the stream never frees a
    layer that user has not moved past, so its recordings are still there when it asks (a stream
    that ignored any one user would free its layer under it: LayerGone)."""
    prefixes = [f"model.layers.{i}.self_attn." for i in range(3)]
    shared = Calibration(TRAIN_TXT, 600, keep="attention", users=users).bind(EXAMPLE_MHA8)
    _, errors = _run_users(shared, users, prefixes, slow, delay=0.1)
    assert not errors, errors
    assert shared.record["layers_run"] == len(prefixes) and shared.record["passes"] == 1


def test_a_user_asking_for_a_layer_the_stream_has_left_is_told_why(one_torch_thread):
    """A layer run and freed (every user took it and moved on) is not 'no attention module': the
    error says the stream moved on, as `LayerGone` does for what a layer no longer holds."""
    import threading

    prefixes = [f"model.layers.{i}.self_attn." for i in range(3)]
    shared = Calibration(TRAIN_TXT, 600, users=2).bind(EXAMPLE_MHA8)
    threads = [threading.Thread(target=lambda u=u: [shared.sigma(p, u) for p in prefixes]) for u in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    with pytest.raises(LayerGone, match=r"layer 0 \(model.layers.0.self_attn\) is gone: the calibration stream "
                                        r"had moved on to layer 3 when user 0 asked for it"):
        shared.sigma(prefixes[0], 0)


def test_a_user_that_fails_stops_the_others_waiting(one_torch_thread):
    """One user ending with an error (its conversion failed) ends the others' waits with an error,
    instead of leaving them blocked on a layer it will never move past."""
    shared = Calibration(TRAIN_TXT, 600, users=2).bind(EXAMPLE_MHA8)
    shared.sigma("model.layers.0.self_attn.", 0)
    shared.leave(1, failed="RuntimeError('boom')")
    with pytest.raises(RuntimeError, match="stopped: RuntimeError..boom"):
        shared.sigma("model.layers.1.self_attn.", 0)


# ------------------------------------------------------------------ memory: one layer, not the model

LAYERS, WIDTH, FFN, TOKENS = 48, 512, 1024, 256
RSS_SCRIPT = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    import transformers.models.llama.modeling_llama, tokenizers
    from transformers import AutoTokenizer, AutoConfig, AutoModelForCausalLM
    from uptrain.convert.layers.calibrate import Calibration

    def status(key):  # kB -> bytes; VmHWM, not ru_maxrss, which Linux carries over from the forking parent
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))
    # constructed first: it reads the text once (the data reader imports datasets/pyarrow, ~90 MB
    # that belong to the process, not to the model)
    c = Calibration(sys.argv[2], int(sys.argv[3])).bind(sys.argv[1])
    before = status("VmRSS")
    for prefix in sorted("model.layers.%d.self_attn." % i for i in range(int(sys.argv[4]))):
        c.sigma(prefix)  # in the order the conversion asks: tensor names sort layers.10 before layers.2
    print(before, status("VmHWM"), c.record.get("layers_run", 0))
""")


def write_deep_model(folder: Path) -> int:
    """A 48-layer Llama of width 512 as bf16 safetensors shards (one per 8 layers), written a layer
    at a time without building the model; returns its float32 size in bytes."""
    from safetensors.torch import save_file

    folder.mkdir()
    cfg = AutoConfig.for_model("llama", hidden_size=WIDTH, num_attention_heads=8, num_key_value_heads=8,
                               num_hidden_layers=LAYERS, intermediate_size=FFN, vocab_size=512,
                               max_position_embeddings=512, tie_word_embeddings=True)
    cfg.save_pretrained(folder)
    with_tokenizer(folder)
    gen = torch.Generator().manual_seed(0)
    shapes = {"self_attn.q_proj.weight": (WIDTH, WIDTH), "self_attn.k_proj.weight": (WIDTH, WIDTH),
              "self_attn.v_proj.weight": (WIDTH, WIDTH), "self_attn.o_proj.weight": (WIDTH, WIDTH),
              "mlp.gate_proj.weight": (FFN, WIDTH), "mlp.up_proj.weight": (FFN, WIDTH),
              "mlp.down_proj.weight": (WIDTH, FFN), "input_layernorm.weight": (WIDTH,),
              "post_attention_layernorm.weight": (WIDTH,)}
    weight_map, total = {}, 0
    for shard in range(LAYERS // 8):
        tensors = {"model.embed_tokens.weight": torch.randn(512, WIDTH, generator=gen),
                   "model.norm.weight": torch.ones(WIDTH)} if shard == 0 else {}
        for i in range(shard * 8, shard * 8 + 8):
            for name, shape in shapes.items():
                value = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) / WIDTH ** 0.5
                tensors[f"model.layers.{i}.{name}"] = value
        file = f"model-{shard:05d}.safetensors"
        save_file({k: v.bfloat16() for k, v in tensors.items()}, folder / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file)
        total += sum(v.numel() * 4 for v in tensors.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total


def test_peak_memory_is_one_layer_not_the_model(tmp_path):
    """Calibrating a 48-layer model (403 MiB float32) in a fresh process: the peak RSS grows by
    less than one layer + activations + moments + 64 MiB of working margin, a fifth of the model."""
    folder = tmp_path / "deep"
    model_bytes = write_deep_model(folder)
    layer_bytes = (4 * WIDTH * WIDTH + 3 * FFN * WIDTH + 2 * WIDTH) * 4
    activations = TOKENS * WIDTH * 4
    moments = 10 * (WIDTH + 1) ** 2 * 8  # asked in name order, at most layers 2..9 wait at once
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}
    run = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(folder), str(TRAIN_TXT), str(TOKENS), str(LAYERS)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    before, peak, layers_run = map(int, run.stdout.split()[-3:])
    grown = peak - before
    bound = layer_bytes + activations + moments + 64 * 2**20
    print(f"model {model_bytes / 2**20:.0f} MiB, layer {layer_bytes / 2**20:.1f} MiB, "
          f"grown {grown / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB")
    assert grown < bound, f"peak RSS grew {grown / 2**20:.0f} MiB, over {bound / 2**20:.0f} MiB"
    assert layers_run == LAYERS
    assert bound < model_bytes / 4


def _run_users(shared, users: int, prefixes: list[str], slow: int, delay: float) -> tuple[dict, list]:
    """Each user of `shared` in its own thread takes every layer's moments in turn; user `slow`
    waits `delay` s at each layer (the others run ahead meanwhile, as far as the stream lets them)
    and then asks for the layer's recordings, which must still be there. (moments per user, errors)."""
    import threading

    got: dict[int, list] = {u: [] for u in range(users)}
    errors: list = []

    def user(u: int) -> None:
        try:
            for p in prefixes:
                got[u].append(shared.sigma(p, u))
                if u == slow:
                    time.sleep(delay)
                    assert len(shared.layer(p, u).recorded().inputs) > 0
            shared.leave(u)
        except BaseException as err:  # noqa: BLE001 (reported by the caller)
            errors.append(err)
            shared.leave(u, failed=repr(err))
    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return got, errors
