"""gbattn's tokenizer as a transformers ``PreTrainedTokenizerFast`` (what ``AutoTokenizer`` loads).

The token ids are gbattn's, one for one: no token is added, so the model's embedding rows do not
change. ``eos_token`` (which lm-eval uses as end of text, as a stop string and, without a
``bos_token``, as the prefix of a rolling log-likelihood) is an existing token:

* ``gpt2``, ``hf``: the vocabulary's end-of-text token (:data:`EOS_NAMES`: GPT-2's ``<|endoftext|>``,
  Llama's ``</s>``, ...), else ``<pad>``, else the first token the tokenizer marks special (not its unknown token);
  a tokenizer with none of them is refused (transformers makes its eos token special, so an ordinary one would
  encode otherwise).
* ``bpe`` (the paper's, docs/paper.md): it has no end-of-text token; ``<pad>`` stands in (a token
  the model never saw in training).
* ``char``: ``"\\n"``; for a corpus without newlines (text8), the vocabulary's first character (a space
  there). Decoding with ``skip_special_tokens=True`` drops it, as any special token
  (``gbattn lm-eval`` decodes generations with it kept).

``bos_token`` is the vocabulary's start-of-text token where it has one, a special token named in
:data:`BOS_NAMES` (Llama's ``<s>``, ...; a text token spelled so, as byte-level BPEs may have, is
none): lm-eval conditions a rolling log-likelihood on it, as it does for the checkpoint an upcycled
model came from.

Only a real end-of-text token becomes the model's ``eos_token_id`` (where ``generate()`` stops):
a char model's generations do not end at the first newline. The padding token is ``<pad>`` where
the vocabulary has it, else a real end-of-text token, else none: a token that occurs in text (a char
tokenizer's newline) must not pad, because transformers treats every padding token in a batch as
padding (``generate()`` without an ``attention_mask`` would mask the prompt's newlines, and
``DataCollatorForLanguageModeling`` would never train on them). Pad a char model's batch by giving
``pad_token_id`` and the ``attention_mask`` yourself. The unknown token is gbattn's (``<unk>``, or as the
tokenizer's model names it, e.g. ``[UNK]``)
(a char tokenizer has none: unseen characters are an error, as in gbattn); being the ``unk_token``, it is
special, so ``skip_special_tokens=True`` leaves it out of decoded text, where gbattn's decoding shows it
(transformers 5.x marks an ``unk_token`` special again whenever it loads a tokenizer).

A prompt is encoded as gbattn encodes one: with the special tokens the tokenizer's post-processor puts before the
text (a Llama's ``<s>``), not those it puts after it (a T5 or BERT template's ``</s>`` or ``[SEP]``, after which
``generate()`` stopped at once where ``gbattn generate`` went on): :func:`gbattn.data.tokenizer.leading_specials_only`.
"""

from __future__ import annotations

import json

from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer
from transformers import PreTrainedTokenizerFast

from gbattn.data.tokenizer import Tokenizer
from gbattn.errors import CheckpointError
from gbattn.files import error_detail

EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")  # real end-of-text tokens, by convention
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>")  # start-of-text tokens, by convention


def backend_tokenizer(tok: Tokenizer) -> BackendTokenizer:
    """The ``tokenizers`` object with gbattn's ids: the stored JSON (bpe, gpt2, hf), or one WordLevel
    token per character, every character its own piece (spaces and newlines included).

    A tokenizer without a decoder (the paper's BPE) joins its pieces with spaces; in transformers' form
    each piece is written after a space instead, so that a continuation decoded on its own keeps its
    boundary with the text before it: the ``text-generation`` pipeline of transformers 5.x appends
    ``decode(new tokens)`` to the prompt (``"the cat" + "sat"`` read ``"the catsat"``). A whole text
    decodes to gbattn's with one space in front."""
    if tok.kind != "char":
        backend = BackendTokenizer.from_str(tok.prompt_payload)
        if backend.decoder is None:
            backend.decoder = decoders.Replace(Regex(r"\A"), " ")
        return backend
    backend = BackendTokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(tok.chars)}, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # "." left "\n\n" one piece
    backend.decoder = decoders.Fuse()
    return backend


def special_tokens(tok: Tokenizer, vocab: dict[str, int], special: set[str]) -> dict[str, str]:
    """eos, pad, unk and bos tokens (existing tokens only; see the module docstring); ``special``: the
    tokens the tokenizer marks special."""
    candidates = ("\n",) if tok.kind == "char" else (*EOS_NAMES, "<pad>")
    eos = next((t for t in candidates if t in vocab), None)
    if eos is None and tok.kind == "char":  # a corpus without newlines: token 0 (a character is a token anyway)
        eos = min(vocab, key=vocab.get)
    elif eos is None:  # none of the usual names (a tokenizer given by path): a token it marks special, the first
        # (transformers makes its eos token special, splitting texts at it: an ordinary token, "!", lost its merges,
        # "!!" encoded otherwise than gbattn encodes it, and decoding with skip_special_tokens dropped it)
        # (not the unknown token, which text holds: lm-eval conditioned and stopped on it)
        unknown = {t for t, i in vocab.items() if i == tok.unknown_id}
        eos = min((t for t in special if t in vocab and t not in unknown), key=vocab.get, default=None)
        if eos is None:
            raise CheckpointError(f"the {tok.kind} tokenizer has no end-of-text token (none of "
                                  f"{', '.join(EOS_NAMES)}, <pad>, nor a token it marks special but its unknown one), "
                                  f"which its transformers form needs, and an ordinary token made one would change how "
                                  f"texts holding it encode: add a special end-of-text token to the tokenizer's file")
    out = {"eos_token": eos}
    if "<pad>" in vocab or eos in EOS_NAMES:
        out["pad_token"] = "<pad>" if "<pad>" in vocab else eos
    spelled = {i: t for t, i in vocab.items()}
    if tok.unknown_id in spelled:  # <unk>, or as its model names it (BERT's [UNK]); a char tokenizer has none
        out["unk_token"] = spelled[tok.unknown_id]
    bos = next((t for t in BOS_NAMES if t in vocab and t in special), None)
    if bos is not None:
        out["bos_token"] = bos
    return out


def hf_tokenizer(tok: Tokenizer, model_max_length: int) -> PreTrainedTokenizerFast:
    """gbattn's tokenizer ``tok`` as a ``PreTrainedTokenizerFast`` with the same ids
    (README, "Hugging Face transformers")."""
    backend = backend_tokenizer(tok)
    vocab = backend.get_vocab(with_added_tokens=True)
    marked = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    entries, specials = len(vocab), special_tokens(tok, vocab, marked)
    try:  # (a file the tokenizers library reads but cannot copy: a traceback; gbattn refuses the ones it knows)
        hf = PreTrainedTokenizerFast(
            tokenizer_object=backend, model_max_length=model_max_length, clean_up_tokenization_spaces=False,
            model_input_names=["input_ids", "attention_mask"],  # 4.x would add token_type_ids, which forward() ignores
            padding_side="left",  # a padded batch for generate() (a right-padded row would continue after its padding)
            **specials)
    except Exception as e:  # (the library's own Exception, whatever it holds)
        raise CheckpointError(f"the {tok.kind} tokenizer does not convert to transformers' form "
                              f"({error_detail(e, 120)})") from None
    if len(hf) != entries:  # a special token missing from the vocabulary was added as a new one
        raise CheckpointError(f"the {tok.kind} tokenizer has {entries:,} tokens but its transformers form has "
                              f"{len(hf):,}; special tokens {json.dumps(specials)} must be tokens of the vocabulary")
    return hf


def is_end_of_text(tokenizer: PreTrainedTokenizerFast) -> bool:
    """Whether the tokenizer's eos token really ends a text (not the bpe or char stand-in)."""
    return tokenizer.eos_token in EOS_NAMES


def model_token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int | None]:
    """The model config's pad, bos and eos token ids for ``tokenizer``: ``generate()`` starts at bos without a prompt
    (an upcycled Llama's <s>) and stops at eos, only a real end-of-text token (not the bpe or char stand-ins)."""
    return {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id if is_end_of_text(tokenizer) else None}
