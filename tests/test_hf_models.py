"""A Hugging Face model trains as the model's own function, for every family users train, or is refused by
name (engine/models/hf/). In one process; the strategies' parity on these models is tests/test_user_models.py.

    .venv/bin/python -m pytest tests/test_hf_models.py -q
"""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys

import pytest
import torch

import engine
from engine.models.hf import HFError, check_function
from engine.models.hf import inputs, parts
from engine.models.hf.check import CHECK_ATOL, LOGIT_SCALE
from tests.conftest import ROOT
from tests.hf_families import FAMILIES, REFUSED, build

transformers = pytest.importorskip("transformers")


class ScaledGPT2(transformers.GPT2LMHeadModel):
    """A user's own variant: its forward scales the logits. The head runs the model's own forward, so the
    scale is reproduced, not refused."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 1.5
        return out

TOKENS = 24   # past every window in the table (5)


def large_logits(model):
    """A copy of `model`, fp32, dropout off, its output projection scaled until its largest logit is
    LOGIT_SCALE: a logit cap or scale shows, whatever the random weights give (the check does the same)."""
    twin = copy.deepcopy(model).float().eval()
    ids = torch.randint(0, twin.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        largest = twin(input_ids=ids).logits.abs().max().item()
        for p in twin.get_output_embeddings().parameters():
            p.mul_(LOGIT_SCALE / largest)
    return twin


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_computes_the_models_own_function_or_is_refused_naming_why(family):
    """Equal to `model(ids).logits` to 1e-5 past every window with logits near 100, or a ValueError naming the
    reason: never accepted and computing another function."""
    model = build(family)
    try:
        engine.layers(model)   # its own check, at 48 tokens and past the windows
    except ValueError as e:
        assert family in REFUSED, f"{family} refused: {e}"
        assert REFUSED[family] in str(e) and type(model).__name__ in str(e), str(e)
        return
    assert family not in REFUSED, f"{family} was taken, but {REFUSED.get(family)} is not reproduced"
    twin = large_logits(model)
    layers = engine.layers(twin, check=False).eval()
    assert layers.names == ["embed", *(f"block{i}" for i in range(4)), "norm", "head"]
    assert TOKENS > FAMILIES[family].window
    ids = torch.randint(0, twin.config.vocab_size, (2, TOKENS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = twin(input_ids=ids).logits, layers(ids)
    assert want.abs().max() > 20   # large enough that a cap shows (Gemma2 caps at 30: tanh far from linear)
    assert (got - want).abs().max().item() <= CHECK_ATOL


def test_the_layers_are_the_models_own_modules_and_a_tied_embedding_is_declared_once():
    model = build("gemma2")
    layers = engine.layers(model)
    assert layers.layer("block2").block is model.model.layers[2]
    assert layers.layer("norm") is model.model.norm
    assert layers.ties == [[("embed", "runner.embed_tokens.weight"), ("head", "model.lm_head.weight")]]
    assert layers.layer("embed").runner.embed_tokens.weight is model.lm_head.weight
    own = {id(p) for p in model.parameters()}
    assert {id(p) for p in layers.parameters()} == own   # every parameter of the model, each once, no copy


def test_a_users_own_subclass_computes_its_own_function():
    torch.manual_seed(0)
    model = ScaledGPT2(FAMILIES["gpt2"].config()).eval()
    layers = engine.layers(model).eval()
    ids = torch.randint(0, 64, (2, TOKENS))
    with torch.no_grad():
        torch.testing.assert_close(layers(ids), model(input_ids=ids).logits, rtol=0, atol=0)


# --- the check sees what differs, and says where ---------------------------------------------------------
def test_a_head_without_the_families_logit_cap_is_refused(monkeypatch):
    monkeypatch.setattr(parts.Head, "forward", lambda self, hidden: self.model.lm_head(hidden))
    with pytest.raises(HFError, match=r"Gemma2ForCausalLM: .*another function.*after the blocks"):
        engine.layers(build("gemma2"))


def test_a_block_handed_another_layer_types_mask_is_refused_naming_the_argument(monkeypatch):
    arguments = inputs.BlockInputs.arguments
    monkeypatch.setattr(inputs.BlockInputs, "arguments", lambda self, i, h, d: arguments(self, 0, h, d))
    with pytest.raises(HFError, match="block 1 is handed another attention_mask"):
        engine.layers(build("gemma2"))   # block 0 sliding, block 1 full


def test_a_block_argument_that_depends_on_the_tokens_is_refused_naming_it():
    model = build("llama")

    def from_the_tokens(module, args, out):   # a rotary table that follows the embeddings' values
        cos, sin = out
        return cos + args[0].mean(), sin
    model.model.rotary_emb.register_forward_hook(from_the_tokens)
    with pytest.raises(HFError, match=r"block 0's argument position_embeddings\[0\] depends on the token ids"):
        engine.layers(model)


# --- sizes -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family, positions", [("gpt2", "n_positions = 32"), ("opt", "max_position_embeddings = 32"),
                                               ("gptj", "max_position_embeddings = 32")])
def test_a_sequence_past_the_models_positions_is_refused_naming_both_numbers(family, positions):
    """GPT-2's learned positions, OPT's (offset by 2) and GPT-J's sinusoidal table: 32 positions, 64 tokens."""
    config = FAMILIES[family].config()
    config.max_position_embeddings = 32
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=rf"data.seq_len = 64 is past {type(model).__name__}'s table of positions: "
                                         rf"it takes at most 32 tokens \(.*{positions}.*\); set data.seq_len to 32"):
        engine.layers(model, seq_len=64)
    engine.layers(model, seq_len=32)


def test_a_rotary_model_is_not_refused_past_max_position_embeddings():
    config = FAMILIES["llama"].config()
    config.max_position_embeddings = 16
    from transformers import AutoModelForCausalLM
    engine.layers(AutoModelForCausalLM.from_config(config), seq_len=64)


def test_engine_train_refuses_a_sequence_past_the_positions_before_anything_starts(tmp_path):
    config = FAMILIES["gpt2"].config()
    config.n_positions = 32
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 64, (16, 65))
    data = engine.tensor_dataset(ids[:, :-1], ids[:, 1:])
    cfg = {"run": {"name": "too-long", "dir": str(tmp_path / "runs")}}
    with pytest.raises(ValueError, match=r"data.seq_len = 64 is past GPT2LMHeadModel's table of positions: it takes "
                                         r"at most 32 tokens"):
        engine.train(cfg, model=model, data=data)
    assert not (tmp_path / "runs").exists()   # refused before a run directory or a worker


# --- what the blocks share -------------------------------------------------------------------------------
def test_each_layer_types_mask_and_rotary_table_is_computed_once_and_shared():
    """Gemma2 alternates sliding and full layers: blocks 0 and 2 get one sliding mask object, 1 and 3 one full
    mask; all four one rotary table. Nothing of it is a parameter, a buffer or in state_dict; the ledger
    counts each tensor once."""
    model = build("gemma2").eval()
    layers = engine.layers(model)
    keys_before = set(layers.state_dict())
    ids = torch.randint(0, 64, (2, TOKENS))
    with torch.no_grad():
        layers(ids)
    blocks = [layers.layer(f"block{i}") for i in range(4)]
    handed = [b.arguments(torch.zeros(2, TOKENS, 32))[1] for b in blocks]
    assert handed[0]["attention_mask"] is handed[2]["attention_mask"]
    assert handed[1]["attention_mask"] is handed[3]["attention_mask"]
    assert handed[0]["attention_mask"] is not handed[1]["attention_mask"]
    assert all(h["position_embeddings"] is handed[0]["position_embeddings"] for h in handed)
    inputs = blocks[0].inputs
    assert all(b.inputs is inputs for b in blocks)
    masks = 2 * 2 * TOKENS * TOKENS * 4   # two [2, 1, T, T] fp32 masks (eager)
    rotary = 2 * TOKENS * 8 * 4          # cos and sin, [1, T, head_dim] fp32
    positions = TOKENS * 8               # position_ids, [1, T] int64
    assert inputs.nbytes() == masks + rotary + positions
    assert set(layers.state_dict()) == keys_before and not any("inputs" in k for k in keys_before)
    from engine.runtime.devices import MemoryLedger
    ledger = MemoryLedger(1 << 30)
    ledger.track_module(layers)
    assert ledger.bytes["inputs"] == masks + rotary + positions
    # the bytes are counted once per change of what is held (the ledger asks every step): another shape's
    # arguments come in beside, and past SHAPES_KEPT the oldest go
    from engine.models.hf.inputs import SHAPES_KEPT
    from engine.models.layers import SharedInputs
    for tokens in range(TOKENS - 1, TOKENS - 2 - SHAPES_KEPT, -1):
        with torch.no_grad():
            layers(ids[:, :tokens])
        ledger.refresh()
        assert ledger.bytes["inputs"] == inputs.nbytes() == SharedInputs.nbytes(inputs) != masks + rotary + positions
    assert len(inputs._cache) == SHAPES_KEPT


def test_a_mask_a_block_saves_for_backward_is_not_counted_again_as_an_activation():
    """sdpa saves its mask for backward; the ledger counts the mask under inputs, once, never as an activation
    (nor would a swap policy copy it to the host)."""
    from engine.models.layers import shared_input_ptrs, shared_inputs
    from engine.runtime.devices import MemoryLedger
    layers = engine.layers(build("mistral"))
    ledger = MemoryLedger(1 << 30)
    ledger.track_module(layers)
    ids = torch.randint(0, 64, (2, TOKENS))
    layers(ids).sum().backward()   # the first step makes the mask
    ledger.refresh()
    mask = layers.layer("block0").arguments(torch.zeros(2, TOKENS, 32))[1]["attention_mask"]
    assert mask is not None and ledger.bytes["inputs"] >= mask.numel()
    with ledger.saved_activations():
        out = layers(ids)
        assert set(ledger._saved) and not set(ledger._saved) & shared_input_ptrs(shared_inputs([layers]))
        out.sum().backward()


def test_a_stage_without_the_embedding_computes_its_blocks_arguments_itself():
    """A pipeline stage holds its own copy (torch.save, as the workers load it): blocks 2 and 3 run from a hidden
    state alone, the arguments computed on its side, and equal the whole model's."""
    model = build("gemma3-text").eval()
    layers = engine.layers(model).eval()
    buffer = io.BytesIO()
    torch.save(layers, buffer)
    buffer.seek(0)
    stage = torch.load(buffer, weights_only=False).eval()
    assert stage.layer("block2").inputs.nbytes() == 0   # nothing computed travels with it
    ids = torch.randint(0, 64, (2, TOKENS))
    with torch.no_grad():
        hidden = layers.layer("block1")(layers.layer("block0")(layers.layer("embed")(ids)))
        want = layers(ids)
        for name in ("block2", "block3", "norm", "head"):
            hidden = stage.layer(name)(hidden)
    assert torch.equal(hidden, want)


def test_bf16_weights_get_their_rotary_tables_in_bf16_and_the_meta_device_runs_for_sizes():
    model = build("mistral")
    layers = engine.layers(model)
    block = layers.layer("block0")
    cos, sin = block.arguments(torch.zeros(1, 8, 32))[1]["position_embeddings"]
    assert cos.dtype == sin.dtype == torch.float32
    layers.to(torch.bfloat16)   # cast after the block has run: its next arguments follow the weights
    cos, sin = block.arguments(torch.zeros(1, 8, 32, dtype=torch.bfloat16))[1]["position_embeddings"]
    assert cos.dtype == sin.dtype == torch.bfloat16
    with torch.device("meta"):
        big = type(model)(FAMILIES["mistral"].config())
    out = engine.layers(big, check=False)(torch.zeros(2, 4096, dtype=torch.long, device="meta"))
    assert out.shape == (2, 4096, 64) and out.device.type == "meta"


def test_the_check_of_a_large_model_runs_on_a_reduced_copy_from_its_config():
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):   # Mistral-7B's config: 32 blocks, 4096 wide, a window of 4096
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("mistral", sliding_window=4096))
    report = check_function(model, seq_len=1024)
    assert report.lengths == [1024, 4097] and report.max_diff <= CHECK_ATOL
    assert report.subject.startswith("a reduced copy (2 blocks, 32 wide")


# --- from a config file ---------------------------------------------------------------------------------
def _write_tokens(path, n: int, vocab: int) -> None:
    import numpy as np
    np.random.default_rng(0).integers(0, vocab, n, dtype=np.uint16).tofile(path)


@pytest.mark.timeout(120)
def test_trainyard_run_refuses_before_any_worker_starts(tmp_path):
    """A sequence past GPT-2's 32 positions, and a Mixtral whose training loss would add the router's: exit 2,
    one line naming the reason, no worker started, no restart."""
    _write_tokens(tmp_path / "train.bin", 4096, 64)
    cases = {"positions": ("gpt2", {"n_positions": 32}, "data.seq_len = 64 is past GPT2LMHeadModel's table of "
                                                        "positions: it takes at most 32 tokens"),
             "router": ("mixtral-router-loss", {}, "output_router_logits = true adds the router's load-balancing loss")}
    for name, (family, extra, words) in cases.items():
        config = FAMILIES[family].config()
        for k, v in extra.items():
            setattr(config, k, v)
        config.to_json_file(tmp_path / f"{name}.json")
        (tmp_path / f"{name}.toml").write_text(
            f'[run]\nname = "{name}"\ndir = "{tmp_path / "runs"}"\n[model]\nname = "hf"\n'
            f'hf_config = "{tmp_path / f"{name}.json"}"\n[data]\nname = "tokens"\ntrain = "{tmp_path / "train.bin"}"\n'
            f'seq_len = 64\nbatch_size = 4\n[parallel]\nworld_size = 2\n[telemetry]\nhub = false\n')
        r = subprocess.run([sys.executable, "-m", "engine.cli", "run", str(tmp_path / f"{name}.toml"), "--headless"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=100,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert r.returncode == 2, (name, r.stderr)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and words in " ".join(r.stderr.split()), (name, r.stderr)
        run_dir = tmp_path / "runs" / name
        assert not (run_dir / "pids").exists() or not list((run_dir / "pids").glob("rank*.pid")), name
