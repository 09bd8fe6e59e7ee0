"""Text generation with the fixed-size KV cache: one prefill of the prompt, then one decode step per
token through the same forward signature (gpt-fast style), eager or compiled. Works on any model
with GPT's ``kv_cache`` / ``setup_cache`` / ``clear_cache`` / ``forward(idx, input_pos=...)`` interface.

The compiled decode step runs through ``torch.compile`` with fixed shapes and no host-device sync
per token (CUDA graphs on CUDA) and gives the eager tokens (tests/test_compiled.py). Compiling
takes seconds, so it is used by default only where it was measured to save more time than it
costs for the cached steps asked for (:data:`MIN_TOKENS_TO_COMPILE`, README "Speed").
"""

from __future__ import annotations

import torch
from torch import Tensor

from gbattn.attention.core import check_mask_dtype, check_tensor, positions_of
from gbattn.checks import MAX_INT, checked
from gbattn.data.tokenizer import refuse_non_utf8
from gbattn.errors import CheckpointError


def is_greedy(temperature: float) -> bool:
    """Whether ``temperature`` decodes greedily: 0 in float32 (2**-150 and below round to it)."""
    return temperature <= 2.0**-150


def sample_next(logits_BV: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None,
                top_p: float | None = None) -> Tensor:
    """Next token ids (B, 1): greedy at temperature 0 (:func:`is_greedy`), else softmax sampling of
    :func:`filtered_logits`."""
    if is_greedy(temperature):
        return logits_BV.argmax(-1, keepdim=True)
    logits_BV = filtered_logits(logits_BV, temperature, top_k, top_p)
    return torch.multinomial(torch.softmax(logits_BV, dim=-1), 1, generator=generator)


def filtered_logits(logits_BV: Tensor, temperature: float, top_k: int | None, top_p: float | None) -> Tensor:
    """Float32 logits divided by ``temperature`` (> 0), then cut to the ``top_k`` largest, then to the nucleus
    (Holtzman et al. 2020: the likeliest tokens whose probabilities reach ``top_p``), cut tokens at -inf. In the
    order and arithmetic of transformers' temperature, top-k and top-p warpers, so that an exported model's
    sampled tokens are gbattn's under the same seed (README, "Hugging Face"), ties included."""
    scaled_BV = logits_BV.float() / temperature
    # A tiny temperature overflows the division; shifted by the row's largest logit first it cannot
    # (the same distribution; chosen per row without a host sync, so other rows keep their bits). On a CPU, where
    # reading the check costs no sync, the usual case (every row finite) skips computing the shifted rows.
    finite_B1 = torch.isfinite(scaled_BV).all(-1, keepdim=True)
    if not (logits_BV.device.type == "cpu" and bool(finite_B1.all())):
        shifted_BV = logits_BV.float() - logits_BV.float().amax(-1, keepdim=True)
        # The largest stays 0 exactly: CUDA divides by a number as a x float32(1 / b), and 1 / b is inf below
        # 2.9e-39 (0 x inf made the row NaN)
        shifted_BV = torch.where(shifted_BV == 0, 0.0, shifted_BV / temperature)
        scaled_BV = torch.where(finite_B1, scaled_BV, shifted_BV)
    logits_BV = scaled_BV
    if top_k is not None and top_k < logits_BV.shape[-1]:
        kth = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        # Ranked from the least likely up, a token is cut while the tokens up to it hold at most 1 - top_p; the most
        # likely one never is (a top_p that is 0 in float32 cut every token, a sampling error). A descending rank
        # (cut once the tokens above hold top_p) is the same set but for ties and rounding, where it kept others.
        ranked_BV, order_BV = torch.sort(logits_BV, dim=-1, descending=False)
        cut_ranked_BV = torch.softmax(ranked_BV, dim=-1).cumsum(-1) <= 1 - top_p
        cut_ranked_BV[:, -1] = False
        logits_BV = logits_BV.masked_fill(cut_ranked_BV.scatter(-1, order_BV, cut_ranked_BV), float("-inf"))
    return logits_BV


class NonFiniteLogits(CheckpointError, ValueError):
    """A model whose logits are NaN or inf: nothing to decode (:func:`generate`)."""


def non_finite_logits(where: str) -> NonFiniteLogits:
    """The error of logits ``where`` ("for the prompt", "at new token 3") that are NaN or inf."""
    return NonFiniteLogits(f"the model's logits {where} are not finite (NaN or inf): its weights are damaged or its "
                           f"training diverged")


def set_eval(model: torch.nn.Module) -> list[tuple[torch.nn.Module, bool]]:
    """Put ``model`` in eval mode; returns each module's own training flag, for :func:`restore_modes` (generation and
    evaluation leave them as they were: ``model.train(was)`` set every module, so a block kept in eval mode while the
    rest fine-tunes came back with its dropout on)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    return modes


def restore_modes(modes: list[tuple[torch.nn.Module, bool]]) -> None:
    """Each module's training flag as :func:`set_eval` found it; the earliest record last, so that the records of two
    calls joined (a model and another sharing modules, or the same model twice) give back the flags found first."""
    for module, training in reversed(modes):
        module.training = training


def eager_decode_step(model):
    """The one-token cached forward: ``step(token_B1, slot_1, position_B1, key_padding_BS) -> logits_BV``."""

    def step(token_B1: Tensor, slot_1: Tensor, position_B1: Tensor | None, key_padding_BS: Tensor | None) -> Tensor:
        return model(token_B1, input_pos=slot_1, position_ids=position_B1, key_padding_mask=key_padding_BS)[:, -1]

    return step


# Fewest cached decode steps for which compiling the step is faster end to end (compile time over the
# time it saves per step, a step being one new token of every row), measured by
# `gbattn bench --compile both` (README, "Compiled vs eager").
# CPU, paper-small, 2 threads, no compile cache, two hosts: compiling took 7-8 s and saved 0.67 ms
# (standard) to 1.36 ms (GBA) per token on one, 4.5-6 s and 0.30 to 0.55 ms on the other, so it pays from
# 6,000 to 15,300 tokens (12,400 to 16,300 at cpu-proxy size); the default is above every figure measured.
# CUDA, one H200, CUDA graphs, paper-small and owt-125m: compiling took 5.7-18 s and decoding ran 4.8-8.8x
# faster, so it pays from 1,100 (GBA) to 1,300 (standard) tokens: above owt-125m's block_size of 1,024, so no
# preset compiles by default; a model with a longer context does.
# None: not measured on that device, so not compiled unless asked for.
MIN_TOKENS_TO_COMPILE: dict[str, int | None] = {"cpu": 17_000, "cuda": 1_400}


def compiled_decode_step(model):
    """:func:`eager_decode_step`, compiled with static shapes: through CUDA graphs on CUDA (as
    ``mode="reduce-overhead"``), through inductor's C++ wrapper on a CPU."""
    device = next(model.parameters()).device
    # In-place buffer reuse off: with it, PyTorch 2.13's inductor miscompiles this step for a model with
    # several layers of 3-round GBA with the mlp gate (NaN logits; tests/test_compiled.py).
    options = {"inplace_buffers": False, "triton.cudagraphs": device.type == "cuda"}
    if device.type == "cpu":
        # The C++ wrapper calls the step's kernels without Python in between: over eager decoding on 2
        # CPU cores, measured 1.4x -> 1.55x (standard) and 1.65x -> 1.8x (GBA) (README, "Compiled vs eager").
        options["cpp_wrapper"] = True
    step = eager_decode_step(model)
    # A code object of its own: dynamo keeps a code object's compilations, at most recompile_limit (8) of them, and
    # every generate(..., compile=True) compiles a step for its model and shapes. Sharing `step`'s code, the ninth
    # call in one process failed (FailOnRecompileLimitHit); now each step's compilations go with it.
    step.__code__ = step.__code__.replace()
    return torch.compile(step, options=options, fullgraph=True, dynamic=False)


def decoder_for(model, compile: bool | None = None, max_new_tokens: int = 0,
                prompt_length: int = 0) -> tuple[object | None, str]:
    """The decode step to use and how to describe it: compiled when asked (``compile=True``), or by
    default (``None``) where compiling was measured faster for the steps it would run on this device:
    one per new token after the first while the sequence fits in ``block_size`` (later tokens are decoded
    without the cache). A prompt of ``prompt_length`` that fills ``block_size`` decodes without a cache, so
    with no step."""
    if prompt_length >= model.cfg.block_size:
        return None, "no cache: the prompt fills block_size"
    device = next(model.parameters()).device
    threshold = MIN_TOKENS_TO_COMPILE.get(device.type)
    cached_steps, past = cache_plan(model.cfg.block_size, max_new_tokens, prompt_length)
    if compile or (compile is None and threshold is not None and cached_steps >= threshold):
        return compiled_decode_step(model), f"KV cache, compiled decode step{past}"
    return None, f"KV cache{past}"


def cache_plan(block_size: int, max_new_tokens: int, prompt_length: int) -> tuple[int, str]:
    """(cached decode steps, ``"; no cache past block_size=N"`` or ``""``) of ``max_new_tokens`` new tokens after a
    prompt of ``prompt_length`` that fits: the prefill predicts the first new token; each later one takes a cached
    step, at slots prompt_length .. block_size - 1. Past them the context is cropped and recomputed: the cache
    serves only the tokens before."""
    cached_steps = max(0, min(max_new_tokens - 1, block_size - prompt_length))
    return cached_steps, "" if max_new_tokens - 1 <= cached_steps else f"; no cache past block_size={block_size}"


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, seed: int | None = None,
                   top_p: float | None = None) -> tuple[int, float, int | None, int | None, float | None]:
    """The sampling options as Python numbers, checked as config fields are (numpy's numbers and an integral float
    such as 4.0 are taken, a bool is not), or a ValueError naming the bad one."""
    max_new_tokens = checked("max_new_tokens", max_new_tokens, int, lambda n: n >= 0, "an integer >= 0")
    # NaN and inf are refused (coerce takes finite numbers only): at inf every token ties and top-k keeps them all
    temperature = checked("temperature", temperature, float, lambda t: t >= 0, "a finite number >= 0 (0 = greedy)")
    if top_k is not None:
        top_k = checked("top_k", top_k, int, lambda k: k >= 1, "an integer >= 1 (or None for no top-k)")
    if top_p is not None:
        top_p = checked("top_p", top_p, float, lambda p: 0 < p <= 1, "a number in (0, 1] (or None for no top-p)")
    if seed is not None:
        seed = checked("seed", seed, int, lambda s: 0 <= s <= MAX_INT,
                        "an integer in [0, 2**63 - 1] (or None for a new draw each time)")
    return max_new_tokens, temperature, top_k, seed, top_p


def check_prompt(idx_BT: Tensor, prompt_mask: Tensor | None) -> Tensor | None:
    """Token ids (B, T) with B, T >= 1, and a ``prompt_mask`` of their shape that is left padding: right
    padding would continue a row after its padding, unlike the row alone (one host sync per call).
    Returns the mask as bool (None without one)."""
    check_tensor("token ids", idx_BT)
    if idx_BT.dim() != 2:
        raise ValueError(f"token ids of shape {tuple(idx_BT.shape)}: expected (batch, tokens)")
    if idx_BT.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if idx_BT.shape[0] == 0:  # (was "setup_cache(batch=0): batch must be an integer >= 1", a call never made)
        raise ValueError("the batch is empty: give at least one row of prompt tokens")
    if prompt_mask is None:
        return None
    check_mask_dtype("prompt_mask", prompt_mask)  # (an additive float mask read inverted: "must be left padding")
    if prompt_mask.device != idx_BT.device:  # (a CUDA prompt with a CPU mask: a torch error mid-decoding)
        raise ValueError(f"prompt_mask on {prompt_mask.device}, token ids on {idx_BT.device}: put both on one device")
    if prompt_mask.shape != idx_BT.shape:
        raise ValueError(f"prompt_mask of shape {tuple(prompt_mask.shape)} for token ids of shape "
                         f"{tuple(idx_BT.shape)}: give one entry per token")
    mask_BT = prompt_mask.bool()
    if not bool(mask_BT[:, -1].all()) or bool((mask_BT[:, 1:] < mask_BT[:, :-1]).any()):
        raise ValueError("prompt_mask must be left padding: in each row the padding (False) comes before the real "
                         "tokens (True), and the last token is real")
    return mask_BT


def _stops(answer) -> bool:
    """``stop``'s answer as one bool for the batch (a tensor of one per row failed in torch, "ambiguous")."""
    # (a list of one per row stopped after the first token, as a non-empty list is true; numpy's array failed)
    size = (answer.numel() if isinstance(answer, Tensor) else len(answer) if isinstance(answer, (list, tuple))
            else getattr(answer, "size", 1))
    if size != 1:
        shape = tuple(getattr(answer, "shape", (size,)))
        raise ValueError(f"stop returned {size} values ({shape}): it ends the whole batch, so return one bool, e.g. "
                         "bool(done_B.all()) to stop once every row is done")
    return bool(answer[0] if isinstance(answer, (list, tuple)) else answer)


@torch.no_grad()
def generate(model, idx_BT: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             seed: int | None = None, use_cache: bool = True, prompt_mask: Tensor | None = None,
             decode_step=None, compile: bool | None = None, progress=None, top_p: float | None = None,
             stop=None) -> Tensor:
    """Continue ``idx_BT`` by ``max_new_tokens`` tokens; returns (B, T + max_new_tokens) (README, "Using gbattn
    from Python").

    ``top_k``: sample from the k largest logits (None, or a k of the vocabulary's size or more: from all of them).
    ``top_p``: then from the most likely tokens that together hold at least this probability (None or 1: all).
    ``prompt_mask`` (B, T): True for real prompt tokens, for a left-padded batch (each row then
    continues as it would alone while the sequence fits in ``block_size``; past it a row's window
    still holds its padding). ``decode_step``: a replacement for the one-token cached forward
    ``step(token_B1, slot_1, position_B1, key_padding_BS) -> logits_BV``; by default the compiled one
    where that is faster (``compile=None``, :func:`decoder_for`), ``compile=False`` never. A compiled step
    (:func:`compiled_decode_step`) passed in is compiled for the cache of this call's prompt length plus
    ``max_new_tokens``: reused for other lengths it compiles again, at most 8 times in all. Once the
    sequence fills the model's ``block_size``, later tokens are predicted from the last ``block_size``
    tokens without a cache, as nanoGPT does; a prompt longer than ``block_size`` is returned whole,
    the model seeing its end.
    ``progress(1)`` is called after each new token (e.g. a progress bar's update). ``stop(new_BN)``, called after each
    new token with the new tokens so far (B, N), ends the decoding when it returns True (e.g. :class:`StopStrings`;
    one host sync per token), so fewer than ``max_new_tokens`` may come back. The model's
    training mode and its own KV cache (``setup_cache``) are as they were afterwards. A KeyboardInterrupt
    (Ctrl-C) that stops it carries the tokens so far, prompt included, as ``partial_BT``.
    """
    max_new_tokens, temperature, top_k, seed, top_p = check_sampling(max_new_tokens, temperature, top_k, seed, top_p)
    # (a string read as True: compile="no" compiled; use_cache=None decoded without the cache)
    use_cache = checked("use_cache", use_cache, bool, None, "True or False")
    if compile is not None:
        compile = checked("compile", compile, bool, None, "True, False or None (compiled where it pays)")
    if stop is not None and not callable(stop):  # (a list of strings failed at the first token, "not callable")
        raise ValueError(f"stop of type {type(stop).__name__}: give a function stop(new_BN) -> bool, e.g. "
                         "StopStrings(tokenizer.decode, strings) (a run's generate takes the strings)")
    for name, function, form in (("progress", progress, "progress(tokens)"),
                                 ("decode_step", decode_step, "step(token_B1, slot_1, position_B1, key_padding_BS)")):
        if function is not None and not callable(function):  # (it failed after the first token, "not callable")
            raise ValueError(f"{name} of type {type(function).__name__}: give a function {form}, or None")
    if not use_cache and (compile or decode_step is not None):  # (each was dropped, unsaid: no decode step runs)
        raise ValueError(f"{'compile=True' if compile else 'decode_step'} is for the cached decode step, and "
                         f"use_cache=False recomputes the whole context at every token: give one of them")
    if not (isinstance(model, torch.nn.Module) and hasattr(model, "setup_cache")):  # (a LoadedRun: no attribute 'cfg')
        raise ValueError(f"model of type {type(model).__name__}: give a GPT (a loaded run's .model, or call the "
                         "run's own .generate)")
    prompt_mask = check_prompt(idx_BT, prompt_mask)
    block = model.cfg.block_size
    B, T = idx_BT.shape
    if prompt_mask is not None and block < T:  # (refused before the model's mode and cache change, below)
        if not bool(prompt_mask.all()):
            raise ValueError(f"a padded prompt of {T} tokens is longer than block_size={block}")
        prompt_mask = None  # no padding (a tokenizer's attention_mask of ones): as a prompt given without one
    device = idx_BT.device
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    # A prompt longer than the model's context is kept whole in the output; the model sees its end.
    kept_BT = idx_BT[:, :-block] if block < T else idx_BT[:, :0]
    if block < T:
        idx_BT, T = idx_BT[:, -block:], block
    mask_BT = prompt_mask if prompt_mask is not None else torch.ones(B, T, dtype=torch.bool, device=device)
    out, cached = idx_BT, use_cache and block > T and max_new_tokens > 0  # (0 new tokens: no prefill to run)
    max_len = min(block, T + max_new_tokens)
    modes, callers_cache = set_eval(model), model.kv_cache
    model.clear_cache()  # generate's own cache or none (use_cache=False), the caller's put back at the end
    try:
        if cached:
            model.setup_cache(B, max_len=max_len)
            key_padding = torch.ones(B, max_len, dtype=torch.bool, device=device)
            key_padding[:, :T] = mask_BT
            key_padding = key_padding if prompt_mask is not None else None
            real_B1 = mask_BT.sum(1, keepdim=True)  # a new token at slot s has position real_b + s - T
            positions = positions_of(mask_BT) if prompt_mask is not None else None
            logits = last_logits(model, out, input_pos=torch.arange(T, device=device), position_ids=positions,
                                 key_padding_mask=key_padding)
            step = decode_step or decoder_for(model, compile, max_new_tokens, T)[0] or eager_decode_step(model)
            # Each step's cache slot a view of one device tensor: a tensor made from a Python number per token
            # would copy it to the device and wait for the GPU (a host sync per token)
            slots_S = torch.arange(max_len, device=device)
        for i in range(max_new_tokens):
            if not cached:
                window = out[:, -block:]
                logits = last_logits(model, window, **_padded_window(mask_BT, out.shape[1], window.shape[1],
                                                                     prompt_mask))
            # Sampling failed with torch's "probability tensor contains either inf, nan", and greedy decoding made
            # garbage, unsaid: checked at every token on a CPU (no host sync there), at the prompt's on a GPU (one)
            if (i == 0 or logits.device.type == "cpu") and not bool(torch.isfinite(logits).all()):
                raise non_finite_logits("for the prompt" if i == 0 else f"at new token {i + 1}")
            try:
                nxt = sample_next(logits, temperature, top_k, generator, top_p)
            except RuntimeError as e:  # a GPU's later token: multinomial's own check
                if "probability tensor contains" not in str(e):
                    raise
                raise non_finite_logits(f"at new token {i + 1}") from None
            out = torch.cat([out, nxt.to(out.dtype)], dim=1)  # the prompt's dtype (int32 ids came back int64)
            if progress is not None:
                progress(1)
            slot = out.shape[1] - 1
            if i == max_new_tokens - 1 or (stop is not None and _stops(stop(out[:, T:]))):
                break  # the last token's logits would go unused
            if cached and slot < max_len:
                pos = None if prompt_mask is None else real_B1 + (slot - T)
                logits = step(nxt, slots_S[slot:slot + 1], pos, key_padding)
            elif cached:
                model.clear_cache()
                cached = False
    except KeyboardInterrupt as interrupt:  # Ctrl-C or SIGTERM: the tokens made so far go with it (`gbattn generate`
        interrupt.partial_BT = torch.cat([kept_BT, out], dim=1)  # prints them)
        raise
    finally:
        model.kv_cache = callers_cache  # (dropped, a decode step the caller makes next had no past, silently)
        restore_modes(modes)
    return torch.cat([kept_BT, out], dim=1)


class StopStrings:
    """The ``stop`` of :func:`generate` for text: True once every row's new text holds one of ``strings``.
    ``decode(ids) -> str`` is the tokenizer's. Each call decodes only the last tokens of each row, enough for the
    longest string, so a long generation does not decode its text again at every token: a token holds at least one
    byte of text (a byte-level tokenizer splits "€" into three), but tokens that decode to no text at all (special
    tokens, left out) are not counted. :meth:`cut` ends a row's text before its first stop string in the new text."""

    def __init__(self, decode, strings) -> None:
        if not isinstance(strings, (str, list, tuple)):  # (a function: "'function' object is not iterable")
            raise ValueError(f"stop strings of type {type(strings).__name__}: give a string or a list of strings "
                             f"(model.generate takes a function as its stop)")
        strings = [strings] if isinstance(strings, str) else list(strings)
        if not strings or not all(isinstance(text, str) and text for text in strings):
            raise ValueError(f"stop strings {strings!r}: give one or more non-empty strings")
        for text in strings:  # (a byte of a shell argument in another encoding was a UnicodeEncodeError traceback)
            refuse_non_utf8(text)
        self.decode, self.strings = decode, strings
        # tokens of text: the longest string's UTF-8 bytes, and one more, whose text may start it (in characters, a
        # stop string a byte-level tokenizer spelled in more tokens than that never ended a generation)
        self.window = max(len(text.encode("utf-8")) for text in strings) + 1
        self._silent: dict[int, bool] = {}  # token id: whether it decodes to no text
        self.stopped: list[bool] = []

    def __call__(self, new_BN: Tensor) -> bool:
        if new_BN.shape[1] == 1 or len(self.stopped) != new_BN.shape[0]:  # a new generation: no row has stopped
            self.stopped = [False] * new_BN.shape[0]
        for b, stopped in enumerate(self.stopped):
            if not stopped:
                text = self.decode(self._tail(new_BN[b]))
                self.stopped[b] = any(stop in text for stop in self.strings)
        return all(self.stopped)

    def _tail(self, row_N: Tensor) -> list[int]:
        """The last tokens of a row holding :attr:`window` tokens that decode to some text (all of it if fewer)."""
        length = min(row_N.shape[0], 4 * self.window)
        while True:
            row, counted = row_N[-length:].tolist(), 0
            for start in range(len(row) - 1, -1, -1):
                if row[start] not in self._silent:
                    self._silent[row[start]] = self.decode([row[start]]) == ""
                counted += not self._silent[row[start]]
                if counted == self.window:
                    return row[start:]
            if length == row_N.shape[0]:
                return row
            length = min(row_N.shape[0], 2 * length)

    def text(self, ids: list[int], prompt_length: int) -> str:
        """A row's tokens (its prompt's ``prompt_length`` first) decoded, up to its first stop string (:meth:`cut`)."""
        return self.cut(self.decode(ids), self.decode(ids[prompt_length:]))

    def cut(self, text: str, new_text: str) -> str:
        """``text`` (prompt and new tokens decoded together) up to the first stop string of ``new_text`` (the new
        tokens decoded alone, which ends ``text``; where it does not, the search starts after ``text``'s first
        ``len(text) - len(new_text)`` characters), the stop string left out; ``text`` itself where none is found."""
        start = len(text) - len(new_text)
        found = [i for i in (text.find(stop, max(start, 0)) for stop in self.strings) if i >= 0]
        return text[:min(found)] if found else text


def last_logits(model, idx_BT: Tensor, **kwargs) -> Tensor:
    """The logits (B, V) of the last position of ``idx_BT`` (``logits_to_keep=1``: its final hidden state alone
    through the LM head). The whole window's (B, T, V) were made and kept alive by a view of their last row until the
    next step's were made (256 samples past block_size: 1.38 GB; 0.33 GB so)."""
    return model(idx_BT, logits_to_keep=1, **kwargs)[:, -1]


def _padded_window(mask_BT: Tensor, length: int, window: int, prompt_mask: Tensor | None) -> dict:
    """Keyword arguments of an uncached forward over the last ``window`` of ``length`` tokens."""
    if prompt_mask is None:
        return {}
    B = mask_BT.shape[0]
    full = torch.cat([mask_BT, mask_BT.new_ones(B, length - mask_BT.shape[1])], dim=1)[:, -window:]
    return {"key_padding_mask": full, "position_ids": positions_of(full)}
