"""Before a run starts: is the LayerList made of a Hugging Face model the model's own function, and does the
run's sequence fit the model's positions?

    report = check_function(model, seq_len=2048)   # HFError naming the reason, or a CheckReport
    report.subject, report.lengths, report.max_diff, report.seconds

What is compared: `model(ids).logits` against the LayerList's output, in fp32 with dropout off, to 1e-5, at the
run's `seq_len` and one token past every window the config names (sliding windows, attention chunks), whichever
are longer, up to MAX_CHECK_TOKENS. Differences show only where they can: a sliding mask only past its window
(below it sdpa skips the mask altogether), a logit cap only on large logits. So the output projection of the
copy is scaled until its largest logit is LOGIT_SCALE: a cap of 30 (Gemma2) or a scale of 0.5 (Cohere) then
changes the logits by far more than the tolerance, whatever the user's own logits are. (The other way, comparing
before the head's nonlinearity and after it separately, needs to know where that nonlinearity is: the
family's code, which this check must not assume.)

On what: a copy of the model where it is small (SMALL_PARAMS), so the user's weights are never touched; else a
reduced copy built from its config (`reduced_copy`): the same class and the same attributes, but one block per
kind of block (layer type, per-layer flags, dense or expert MLP), 32 wide, 2 heads and a vocabulary of 256. The
function's structure (masks, positions, scales, caps) is in the code and the config, not in the widths. A
model on the meta device (built for its sizes) is always checked on a reduced copy, so the check costs a few
hundred milliseconds at start whatever the model's size.

A difference is explained, not only measured (`diagnose`): the model's own forward is recorded with every block
wrapped, and the first disagreement is named: the embedding part, a block's argument (or one that depends on
the token ids, found by recording twice), or the head.

Positions: a forward at `seq_len` that indexes past a table of positions (GPT-2's wpe, OPT's learned positions,
GPT-J's sinusoidal table) fails on the CPU with an index error; the check then finds the longest sequence
the model takes and refuses the run naming both numbers. A rotary model takes any length and is not refused.
Past MAX_CHECK_TOKENS the forward is not run at `seq_len` (an attention over 8k tokens costs more than a
start should): the part before the blocks (learned positions) is run there alone.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.models.hf.anatomy import Anatomy, HFError, read_anatomy, text_config

CHECK_ATOL = 1e-5
LOGIT_SCALE = 100.0
MAX_CHECK_TOKENS = 8192
DEFAULT_TOKENS = 48   # the length checked when the run's is not known (engine.layers(model) alone)
SMALL_PARAMS = 20_000_000
WINDOW_KEYS = ("sliding_window", "attention_chunk_size", "sliding_window_size")
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")
REDUCED_VOCAB = 256

# widths of a reduced copy, by the config's canonical attribute names (attribute_map gives a family's own);
# one that is None stays None (a default the config derives)
NARROW = {"hidden_size": 32, "num_attention_heads": 2, "head_dim": 16, "intermediate_size": 64, "ffn_dim": 64,
          "n_inner": 64, "ffn_hidden_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
          "word_embed_proj_dim": 16, "rotary_dim": 8, "kv_lora_rank": 16, "q_lora_rank": 16,
          "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}
FEWER = {"num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
         "n_shared_experts": 1, "n_group": 1, "topk_group": 1}


@dataclass
class CheckReport:
    subject: str                     # "the model" or "a reduced copy (...)"
    lengths: list[int] = field(default_factory=list)
    max_diff: float = 0.0
    seconds: float = 0.0


def _positions_limit_names(config) -> list[tuple[str, int]]:
    text = text_config(config)
    return [(k, getattr(text, k)) for k in POSITION_KEYS if isinstance(getattr(text, k, None), int)]


def windows(config) -> list[int]:
    text = text_config(config)
    return [v for k in WINDOW_KEYS for v in [getattr(text, k, None)] if isinstance(v, int) and v > 0]


def check_lengths(config, seq_len: int | None) -> list[int]:
    """The sequence lengths the check runs at: the run's, and one past the longest window, capped."""
    wanted = {seq_len or DEFAULT_TOKENS, max(windows(config), default=0) + 1}
    return sorted({min(t, MAX_CHECK_TOKENS) for t in wanted if t > 1})


# --- the copy the check runs on ------------------------------------------------------------------------
def _key(config, name: str) -> str:
    return getattr(config, "attribute_map", {}).get(name, name)


def _kinds(config, n: int) -> list[int]:
    """One block index per kind of block: layer type, per-layer flags (lists of n values), dense or expert
    MLP (first_k_dense_replace, mlp_only_layers, decoder_sparse_step); the second block too, so the handoff
    from one block to the next is exercised."""
    table = config.to_dict()
    lists = {k: v for k, v in table.items() if isinstance(v, list) and len(v) == n}
    dense = table.get("first_k_dense_replace") or 0
    mlp_only = set(table.get("mlp_only_layers") or [])
    step = table.get("decoder_sparse_step") or 1

    def kind(i):
        return (tuple(repr(v[i]) for v in lists.values()), i < dense, i in mlp_only or (i + 1) % step != 0)

    first: dict = {}
    for i in range(n):
        first.setdefault(kind(i), i)
    return sorted(set(first.values()) | ({1} if n > 1 else set()))


def reduced_config(config, narrow: bool = True, shallow: bool = True):
    """`config` with a small vocabulary, with `shallow` one block per kind (see _kinds), with `narrow` small
    widths."""
    text = text_config(config)
    if text is not config:
        raise HFError(f"{type(config).__name__} nests its text model's config; trainyard takes a decoder-only "
                      f"causal LM's own config")
    table = copy.deepcopy(config.to_dict())
    n = getattr(config, "num_hidden_layers")
    keep = _kinds(config, n) if shallow else list(range(n))
    for k, v in list(table.items()):
        if isinstance(v, list) and len(v) == n:
            table[k] = [v[i] for i in keep]
    if table.get("first_k_dense_replace"):
        table["first_k_dense_replace"] = sum(1 for i in keep if i < table["first_k_dense_replace"])
    if "decoder_sparse_step" in table or table.get("mlp_only_layers"):
        mlp_only, step = set(table.get("mlp_only_layers") or []), table.get("decoder_sparse_step") or 1
        table["mlp_only_layers"] = [j for j, i in enumerate(keep) if i in mlp_only or (i + 1) % step != 0]
        table["decoder_sparse_step"] = 1
    table[_key(config, "num_hidden_layers")] = len(keep)
    vocab_key = _key(config, "vocab_size")
    table[vocab_key] = min(table[vocab_key], REDUCED_VOCAB)
    for k, v in list(table.items()):   # special tokens past the smaller vocabulary (a pad id is an index)
        if k.endswith("_token_id") and isinstance(v, int) and v >= table[vocab_key]:
            table[k] = 0
        elif k.endswith("_token_id") and isinstance(v, list):
            table[k] = [t for t in v if t < table[vocab_key]] or [0]
    if narrow:
        heads_key, kv_key = _key(config, "num_attention_heads"), _key(config, "num_key_value_heads")
        heads, kv = table.get(heads_key), table.get(kv_key)
        for name, value in {**NARROW, **FEWER}.items():
            key = _key(config, name)
            if table.get(key) is not None:
                table[key] = min(table[key], value) if name in FEWER else value
        if isinstance(kv, int) and isinstance(heads, int):   # keep multi-head, grouped or multi-query
            table[kv_key] = 2 if kv == heads else 1
        for key in ("num_kv_heads",):   # Falcon's own name
            if isinstance(table.get(key), int):
                table[key] = 2 if table[key] == heads else 1
    table.pop("transformers_version", None)
    if dataclasses.is_dataclass(config):   # its own fields only: what it derives from them, it derives anew
        fields = {f.name for f in dataclasses.fields(config)}
        new = type(config)(**{k: v for k, v in table.items() if k in fields})
    else:
        new = type(config).from_dict(table)
    new._attn_implementation = config._attn_implementation
    return new


def _build(model_class, config) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with torch.device("cpu"):
            return model_class(config)


def _same_structure(a: Anatomy, b: Anatomy) -> bool:
    return (a.runner_path, a.blocks_path, a.before, a.after, a.as_tuple) == \
        (b.runner_path, b.blocks_path, b.before, b.after, b.as_tuple)


def subject_for(model: nn.Module, anatomy: Anatomy) -> tuple[nn.Module, Anatomy, str]:
    """The model the check runs: a copy of `model` (SMALL_PARAMS or fewer, on a real device) or a reduced
    copy of the same class, narrow where the narrow one keeps the model's structure."""
    param = next(model.parameters(), None)
    on_meta = param is not None and param.device.type == "meta"
    if not on_meta and sum(p.numel() for p in model.parameters()) <= SMALL_PARAMS:
        twin = copy.deepcopy(model).to("cpu", torch.float32)
        return twin, read_anatomy(twin), "the model (a copy, fp32)"
    errors = []
    # narrow and shallow; at the model's widths (a family whose code fixes some width); at the model's depth (a
    # config that lists every layer's kind in a form of its own, GPT-Neo's attention_types)
    for narrow, shallow in ((True, True), (False, True), (True, False)):
        try:
            config = reduced_config(model.config, narrow, shallow)
            twin = _build(type(model), config).float().eval()
            twin_anatomy = read_anatomy(twin)
            with torch.no_grad():   # widths this family's code does not take fail here, not in the check
                twin(input_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=False)
        except HFError:
            raise
        except Exception as e:   # a width this family's config does not take: try the model's own widths
            errors.append(f"{type(e).__name__}: {e}")
            continue
        if _same_structure(anatomy, twin_anatomy):
            blocks = twin_anatomy.n_blocks
            width = "32 wide, 2 heads" if narrow else "at the model's widths"
            return twin, twin_anatomy, f"a reduced copy ({blocks} blocks, {width}, vocabulary {REDUCED_VOCAB})"
        errors.append("its structure differs from the model's")
        if len(errors) > 3:
            break
    if on_meta:
        raise HFError(f"{anatomy.name}: no reduced copy of it could be built to check it against its own "
                      f"forward ({'; '.join(errors)}); build it on a real device to check it whole")
    twin = copy.deepcopy(model).to("cpu", torch.float32)
    return twin, read_anatomy(twin), "the model (a copy, fp32)"


# --- the comparison ------------------------------------------------------------------------------------
def _tokens(vocab: int, tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    batch = 2 if tokens <= 256 else 1   # two sequences where it is cheap: a batch's rows stay apart
    return torch.randint(0, vocab, (batch, tokens), generator=g)


def _index_error(e: Exception) -> bool:
    text = str(e).lower()
    return isinstance(e, IndexError) or ("index" in text and ("out of" in text or "bounds" in text))


def _runs_at(forward, vocab: int, tokens: int) -> bool:
    try:
        forward(_tokens(vocab, tokens, 0)[:1])
        return True
    except (IndexError, RuntimeError) as e:
        if _index_error(e):
            return False
        raise


def longest_sequence(forward, config, vocab: int, upto: int) -> int:
    """The longest sequence `forward` takes, below `upto`: the config's position sizes first, then halving."""
    for _, size in sorted(_positions_limit_names(config), key=lambda kv: -kv[1]):
        if size < upto and _runs_at(forward, vocab, size) and not _runs_at(forward, vocab, size + 1):
            return size
    lo, hi = 1, upto   # runs at lo, not at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _runs_at(forward, vocab, mid) else (lo, mid)
    return lo


def refuse_past_positions(name: str, config, seq_len: int, limit: int) -> None:
    named = ", ".join(f"{k} = {v}" for k, v in _positions_limit_names(config)) or "its config names no size"
    raise HFError(f"data.seq_len = {seq_len} is past {name}'s table of positions: it takes at most {limit} "
                  f"tokens ({named}); set data.seq_len to {limit} or less")


def _scale_logits(model: nn.Module, vocab: int) -> None:
    """Scale the copy's output projection until its largest logit is LOGIT_SCALE (see the module's doc)."""
    with torch.no_grad():
        largest = model(input_ids=_tokens(vocab, 16, 1), use_cache=False).logits.abs().max().item()
        factor = LOGIT_SCALE / max(largest, 1e-6)
        for p in model.get_output_embeddings().parameters():
            p.mul_(factor)


def check_function(model: nn.Module, seq_len: int | None = None, anatomy: Anatomy | None = None) -> CheckReport:
    """Compare the LayerList made of `model` with `model`'s own forward (see the module's doc); HFError
    naming the reason where they differ or the sequence is past the model's positions."""
    from engine.models.hf import build_layers
    start = time.perf_counter()
    anatomy = anatomy or read_anatomy(model)
    twin, twin_anatomy, subject = subject_for(model, anatomy)
    twin.eval()
    vocab = text_config(twin.config).vocab_size
    layers = build_layers(twin_anatomy).eval()
    lengths = check_lengths(model.config, seq_len)
    report = CheckReport(subject, list(lengths))
    with torch.no_grad():
        own = lambda ids: twin(input_ids=ids, use_cache=False)   # noqa: E731
        if seq_len and seq_len > MAX_CHECK_TOKENS:   # the learned positions alone, at the run's length
            if not _runs_at(layers.layers[0], vocab, seq_len):
                limit = longest_sequence(layers.layers[0], model.config, vocab, seq_len)
                refuse_past_positions(anatomy.name, model.config, seq_len, limit)
        _scale_logits(twin, vocab)
        for tokens in lengths:
            ids = _tokens(vocab, tokens, 2)
            try:
                want = own(ids).logits.float()
            except (IndexError, RuntimeError) as e:
                if not _index_error(e):
                    raise
                limit = longest_sequence(own, model.config, vocab, tokens)
                if seq_len and tokens == min(seq_len, MAX_CHECK_TOKENS):
                    refuse_past_positions(anatomy.name, model.config, seq_len, limit)
                report.lengths.remove(tokens)   # a window longer than the positions never applies
                continue
            try:
                got = layers(ids).float()
            except Exception as e:
                raise HFError(f"{anatomy.name}: the layers trainyard makes of it fail where its own forward runs "
                              f"({type(e).__name__}: {e}, at {tokens} tokens on {subject}); wrap its layers in an "
                              f"engine.LayerList yourself (docs/models.md)") from e
            diff = (got - want).abs().max().item() if got.shape == want.shape else float("inf")
            report.max_diff = max(report.max_diff, diff)
            if not diff <= CHECK_ATOL:
                from engine.models.hf.diagnose import diagnose
                cause = diagnose(twin, twin_anatomy, layers, ids)
                raise HFError(f"{anatomy.name}: the layers trainyard makes of it compute another function than "
                              f"its own forward (logits differ by up to {diff:.3g} at {tokens} tokens, on "
                              f"{subject}): {cause}. Wrap its layers in an engine.LayerList yourself "
                              f"(docs/models.md)")
    report.seconds = time.perf_counter() - start
    return report
