"""gbattn's GPT as a transformers causal LM: ``generate()``, ``Trainer``, ``from_pretrained``.

:class:`GbattnForCausalLM` holds gbattn's :class:`~gbattn.model.gpt.GPT` as ``self.model``, so the
weights keep gbattn's names (``model.blocks.0.attn.qkv.weight``) and every attention variant,
residual stream and block option (docs/baselines.md) runs through gbattn's own code.
:class:`GbattnCache` is the ``Cache`` that ``generate()`` drives: per layer, one named key/value
entry per attention call (GBA's ``kv0``, ``kv1``, ...; Twicing's value-only ``av``; differential
attention's grouped ``kv``), grown by concatenation (gbattn's ``DynamicLayerCache``).
Written for transformers >= 4.57, < 6 (tested: 4.57.6 and 5.25.0).
"""

from __future__ import annotations

import copy
import operator

import torch
import transformers
from torch import Tensor, nn
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from gbattn.attention.boosted import Gate
from gbattn.attention.core import AttentionBase, DynamicLayerCache, check_tensor, positions_of
from gbattn.checks import checked
from gbattn.hf.configuration import GbattnConfig
from gbattn.model.attnres import AttnResStream
from gbattn.model.gpt import GPT, init_weights, lm_loss

try:  # 5.x: init functions that leave tensors loaded from a checkpoint alone (``_is_hf_initialized``)
    from transformers import initialization as hf_init
except ImportError:  # 4.x
    from torch.nn import init as hf_init

TF_MAJOR = int(transformers.__version__.split(".")[0])
# transformers 5.24 renamed the forward/generate keyword and the output field ``past_key_values`` to
# ``cache`` (the old name is accepted with a warning until 5.40); earlier versions use the old name.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


# --------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------


class GbattnLayerCache(DynamicLayerCache):
    """One layer's named entries (gbattn's ``DynamicLayerCache``) with the methods transformers calls."""

    is_sliding = False
    is_compileable = False
    is_croppable = True
    supports_early_init = False
    is_initialized = True

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def _map(self, fn) -> None:
        self.entries = {n: (None if k is None else fn(k), fn(v)) for n, (k, v) in self.entries.items()}

    def crop(self, size: int) -> None:
        """Drop positions from the end, as the installed transformers' dynamic layers crop: a negative ``size``
        drops ``-size`` of them; ``size`` >= 0 is the length to keep under 4.x, while 5.x refuses a positive one
        and drops none for 0. Every entry holds one key and value per position (dim 2), so what is left is what the
        kept positions alone would have left (assisted decoding rolls back the draft tokens it rejects)."""
        if size > 0 and TF_MAJOR >= 5:
            raise ValueError(f"crop({size}): transformers 5 crops by a negative number of positions to remove")
        keep = self.length + size if size < 0 or (size == 0 and TF_MAJOR >= 5) else size  # (4.x: crop(0) empties)
        if 0 <= keep < self.length:
            self._map(lambda t: t[:, :, :keep])

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: Tensor) -> None:
        self.reorder_cache(indices)  # the same row selection

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:  # holding no keys, it serves any model again
        self.entries, self.owner = {}, None

    def offload(self) -> None:  # kept where it is
        pass

    def prefetch(self) -> None:
        pass


class GbattnCache(Cache):
    """A transformers ``Cache`` holding one :class:`GbattnLayerCache` per block
    (README, "Hugging Face transformers"); also gbattn's cache
    interface (``layers``, ``key_length``), so ``GPT.forward(..., cache=...)`` writes to it.

    Every method ``generate()`` may call is defined here, as the base class changed between
    versions (5.x: ``get_max_length``). Not
    compileable; croppable (assisted decoding rolls back the draft tokens it rejects).
    """

    is_compileable = False  # a class attribute shadows the base property: generate() builds no 4D mask

    def __init__(self, n_layers: int) -> None:
        layers = [GbattnLayerCache() for _ in range(n_layers)]
        super().__init__(layers=layers)
        self.layers = layers

    # gbattn's interface ---------------------------------------------------------------
    def key_length(self, T: int) -> int:
        return self.get_seq_length() + T

    # transformers' interface ----------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length if layer_idx < len(self.layers) else 0

    def get_max_length(self, layer_idx: int | None = None) -> int:  # 5.x
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:  # 4.x
        return -1

    @property
    def is_linear(self) -> list[bool]:  # 5.x asks which layers are linear attention (Mamba-like): none are
        return [False] * len(self.layers)

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def is_croppable(self) -> bool:
        return True

    def update(self, *args, **kwargs):
        raise NotImplementedError("GbattnCache is written by gbattn's attention layers (cache.layers[i].update)")

    def crop(self, size: int) -> None:
        """Every layer's :meth:`GbattnLayerCache.crop` (assisted decoding's roll-back of rejected draft tokens)."""
        for layer in self.layers:
            layer.crop(size)

    def reorder_cache(self, beam_idx: Tensor) -> None:
        for layer in self.layers:
            layer.reorder_cache(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        for layer in self.layers:
            layer.batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        for layer in self.layers:
            layer.batch_repeat_interleave(repeats)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def __len__(self) -> int:
        return len(self.layers)

    def __repr__(self) -> str:
        names = sorted(self.layers[0].entries) if self.layers else []
        return f"GbattnCache(layers={len(self.layers)}, length={self.get_seq_length()}, entries={names})"


# --------------------------------------------------------------------------------------
# Initialisation
# --------------------------------------------------------------------------------------


def init_module(module: nn.Module, init=hf_init) -> None:
    """gbattn's initialisation of ``module``'s own parameters (docs/method.md, "Initialisation";
    docs/baselines.md): Linear and Embedding N(0, 0.02) with zero biases (GPT's own
    :func:`gbattn.model.gpt.init_weights`), norms 1 and 0, and what an attention layer, a gate or the
    AttnRes stream sets for the parameters it holds itself (their ``init_own_parameters``, which
    their constructors call too, or draw alike: differential attention's lambdas). Each parameter belongs to one
    of these module types (tests/test_hf.py)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        init_weights(module, init)
    elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        if module.weight is not None:
            init.ones_(module.weight)
        if getattr(module, "bias", None) is not None:
            init.zeros_(module.bias)
    elif isinstance(module, OWN_PARAMETERS):
        module.init_own_parameters(init)


OWN_PARAMETERS = (AttentionBase, Gate, AttnResStream)  # modules that initialise the parameters they hold
INIT_TYPES = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm, *OWN_PARAMETERS)


# --------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------


# transformers' new tokens when a generation sets neither max_new_tokens nor max_length (its default max_length, 20,
# counted from the prompt, then cut to the model's positions; 4.x's GenerationConfig holds it as max_length)
DEFAULT_NEW_TOKENS = 20


class GbattnPreTrainedModel(PreTrainedModel):
    """What the base model and the causal LM share: gbattn's GPT as ``self.model`` (so both hold the same
    ``model.*`` weights), its embeddings, activation checkpointing and the forward pass up to the final norm.

    Initialisation: a model built here keeps the init of gbattn's own constructor (the same
    weights as ``GPT(cfg)`` under the same seed): its parameters are marked initialised, so
    ``post_init()`` draws nothing again. ``_init_weights`` is a faithful replica
    (:func:`init_module`) for what ``from_pretrained`` builds on the meta device and finds missing
    in a checkpoint."""

    config_class = GbattnConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True  # (GPT.set_activation_checkpointing: per block)
    _no_split_modules = ["Block"]
    _supports_cache_class = True  # <= 4.55: lets generate() take a Cache instance
    # gbattn's fast path is F.scaled_dot_product_attention already: attn_implementation="sdpa" (the
    # default) and "eager" both run gbattn's own attention code.
    _supports_sdpa = True
    # 5.x: {tied: source} (applied when config.tie_word_embeddings); 4.x: the list of tied keys.
    _tied_weights_keys = {"model.lm_head.weight": "model.wte.weight"} if TF_MAJOR >= 5 else ["model.lm_head.weight"]

    def _init_weights(self, module: nn.Module) -> None:
        init_module(module)

    def __init__(self, config: GbattnConfig) -> None:
        super().__init__(config)
        self.model = GPT(config.model_config)
        if self.model.cfg.residual != "plain":  # device_map="auto" keeps it whole (_check_placement)
            self._no_split_modules = ["GPT"]
        if self.model.wte.weight.device.type != "meta":  # built for use, not by from_pretrained: keep GPT's init
            mark_initialised(self.model)
        self.post_init()

    @classmethod
    def from_gpt(cls, gpt: GPT, **config_kwargs) -> GbattnPreTrainedModel:
        """Wrap an existing GPT (its parameters are shared, not copied); ``config_kwargs`` go to the
        config (``run=`` the rest of a run's config.json, ``eos_token_id=``, ...). A ``torch.compile``'d
        GPT is wrapped as the GPT it compiles (its weights were saved under ``_orig_mod.`` names,
        which load as missing weights)."""
        gpt = getattr(gpt, "_orig_mod", gpt)  # torch.compile's OptimizedModule holds the module it compiles
        if not isinstance(gpt, GPT):
            raise TypeError(f"from_gpt takes gbattn's GPT (gbattn.model.gpt.GPT, e.g. load_run(...).model), "
                            f"not a {type(gpt).__name__}")
        config = GbattnConfig.from_model_config(gpt.cfg, **config_kwargs)
        with torch.device("meta"):
            model = cls(config)
        model.model = mark_initialised(gpt)
        # The wrapper's own flag only: train() would set every module of the GPT too (a block the caller had put in
        # eval mode trained with dropout again, silently).
        model.training = gpt.training
        return model

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' ``from_pretrained``, with :meth:`_check_placement` of the model it loads (the first of what
        it returns with ``output_loading_info=True``), and the weights gbattn never trains frozen again."""
        loaded = super().from_pretrained(*args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        model._check_placement()
        for module in model.modules():  # (transformers 5 made its weights anew: trainable, unlike gbattn's and 4.x's)
            if isinstance(module, AttnResStream):
                module.freeze_untrained()
        return loaded

    def _check_placement(self) -> None:
        """An Attention Residuals model placed in parts (accelerate's ``device_map``: some blocks offloaded to the
        disk or the CPU, or on other devices) is refused: its stream calls every block's sublayers itself, so the
        hooks that load offloaded weights and move tensors at each block's forward never run (the first forward was
        "Cannot copy out of meta tensor"). Whole on one device, it runs."""
        placed = set((getattr(self, "hf_device_map", None) or {}).values())
        if self.model.cfg.residual != "plain" and (len(placed) > 1 or placed & {"disk", "meta"}):
            raise ValueError(f"residual={self.model.cfg.residual!r}: an Attention Residuals model runs whole on one "
                             f"device, not placed in parts by a device_map ({', '.join(sorted(map(str, placed)))}): "
                             f"its depth attention calls every block itself; give device_map one device, and "
                             f"max_memory room for the whole model")

    # embeddings: tie_weights (4.x), resize_token_embeddings, PEFT ...
    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.wte = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.model.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.model.lm_head = value

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None,
                                    every_n_layers: int = 1) -> None:
        """What ``gradient_checkpointing_enable()`` (``activation_checkpointing_enable()`` in 5.x) and ``_disable()``
        call: gbattn's own per-block checkpointing (:meth:`GPT.set_activation_checkpointing`) with transformers'
        function and its keywords (``use_reentrant``, ...), every ``every_n_layers``-th block (5.x's option)."""
        self.model.set_activation_checkpointing(enable, every_n_layers, gradient_checkpointing_func)

    def resize_token_embeddings(self, *args, **kwargs) -> nn.Embedding:
        """transformers' resize (tied head included; it sets ``config.vocab_size`` itself), with the GPT's own
        config kept in step."""
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        self.model.cfg = self.model.cfg.replace(vocab_size=embeddings.num_embeddings)
        return embeddings

    def _check_inputs(self, input_ids: Tensor | None, inputs_embeds: Tensor | None, attention_mask: Tensor | None,
                      labels: Tensor | None = None) -> None:
        """Check the tokens given, ids (B, T) or embeddings (B, T, D), with the mask and labels beside them, and the
        model's placement (:meth:`_check_placement`; accelerate's dispatch_model places one outside from_pretrained)."""
        self._check_placement()
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError(f"{type(self).__name__} takes input_ids or inputs_embeds, one of the two")
        for name, value in (("input_ids", input_ids), ("inputs_embeds", inputs_embeds),
                            ("attention_mask", attention_mask), ("labels", labels)):
            check_tensor(name, value)  # (a list was "'list' object has no attribute 'dim'")
        check_token_shapes(input_ids, inputs_embeds)
        given, name = (input_ids, "input_ids") if input_ids is not None else (inputs_embeds, "inputs_embeds")
        if labels is not None and labels.shape != given.shape[:2]:
            raise ValueError(f"labels of shape {tuple(labels.shape)} for {name} of shape {tuple(given.shape)}: "
                             f"labels are the input ids (-100 = ignored), shifted inside")
        if labels is not None:  # integers in the vocabulary, or -100, as the GPT's own targets
            self.model.check_targets(labels)

    def _stream(self, input_ids: Tensor | None, inputs_embeds: Tensor | None,
                attention_mask: Tensor | None, position_ids: Tensor | None, cache: Cache | None,
                use_cache: bool | None, output_attentions: bool | None, output_hidden_states: bool | None,
                cache_position: Tensor | None = None) -> tuple[Tensor, tuple | None, GbattnCache | None]:
        """The final norm's output (B, T, D), the hidden states if asked for (transformers' convention: the
        embeddings, each later block's input, then that output), and the cache, through gbattn's GPT:
        ``attention_mask`` (B, past + T) is 1 for real tokens (left padding works); positions come from
        ``position_ids``, else ``cumsum(attention_mask) - 1``, else ``cache_position`` (T,), as Llama reads it,
        else past..past+T-1."""
        if output_attentions if output_attentions is not None else getattr(self.config, "output_attentions", False):
            # (GBA attends M times per layer with other queries and keys; no one (B, H, T, T) map is its attention)
            raise ValueError(f"{type(self).__name__} returns no attention maps (output_attentions asked for, by "
                             "argument or config); use its gbattn GPT, model.model(input_ids, "
                             "return_intermediates=True), for the per-layer records of every attention round")
        if output_hidden_states is None:
            output_hidden_states = getattr(self.config, "output_hidden_states", False)
        if cache is not None and not isinstance(cache, GbattnCache):
            # Another kind of cache would not be written (every GBA round keeps its own keys and values).
            raise TypeError(f"{type(self).__name__} keeps its keys and values in a GbattnCache, not a "
                            f"{type(cache).__name__}: pass None (forward() makes one and returns it) or "
                            f"gbattn.hf.GbattnCache(config.num_hidden_layers)")
        if use_cache is None:
            use_cache = cache is not None or (self.config.use_cache and not self.training)
        if use_cache and cache is None:
            cache = GbattnCache(len(self.model.blocks))
        # A cache that is given is read and extended even with use_cache=False, as transformers' own
        # models do (use_cache only decides whether a new one is made).
        given = input_ids if input_ids is not None else inputs_embeds  # (checked: one of the two)
        B, T = given.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        key_padding_BS = None
        if attention_mask is not None:
            if attention_mask.shape != (B, past + T):
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected (batch, past + "
                                 f"new tokens) = ({B}, {past + T})")
            # 0 and 1 only, as transformers' own models read it: a mask of 2s counted each real token twice in the
            # positions, and an additive float mask (0 keep, -inf drop) said "position_ids reach 2**63 - 1"
            if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
                raise ValueError("attention_mask must hold 0 (padding) and 1 (a real token) only, as a tokenizer "
                                 "returns it; an additive mask (0 keep, -inf drop) is not taken")
            if not bool(attention_mask.all()):
                key_padding_BS = attention_mask.bool()
        if position_ids is None and key_padding_BS is not None:
            position_ids = positions_of(key_padding_BS)[:, -T:]
        elif position_ids is None and cache_position is not None:  # (it was accepted and ignored)
            if cache_position.shape != (T,):
                raise ValueError(f"cache_position has shape {tuple(cache_position.shape)}; expected (new tokens,) = "
                                 f"({T},)")
            position_ids = cache_position.to(given.device).expand(B, T)
        input_pos = torch.arange(past, past + T, device=given.device) if cache is not None else None
        layer_inputs = [] if output_hidden_states else None
        h_BTD, _ = self.model.hidden(input_ids, input_pos=input_pos, position_ids=position_ids,
                                     key_padding_mask=key_padding_BS, cache=cache, layer_inputs=layer_inputs,
                                     token_embeds_BTD=inputs_embeds, own_cache=False)
        return h_BTD, (*layer_inputs, h_BTD) if output_hidden_states else None, cache

    def _output(self, out, return_dict: bool | None):
        """``out``, or its tuple where ``return_dict`` (else the config's) says so."""
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        return out if return_dict else out.to_tuple()


class GbattnModel(GbattnPreTrainedModel):
    """gbattn's GPT as a transformers base model (``AutoModel``): ``last_hidden_state`` is the final norm's output
    (what the LM head reads), for features, probes and heads of one's own. It holds the same ``model.*`` weights as
    :class:`GbattnForCausalLM`, so an exported causal LM loads as either (the head's weight is the embedding's
    where tied, and unused here). ``forward`` takes what the causal LM's does but labels and ``logits_to_keep``
    (README, "Hugging Face transformers")."""

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, cache: Cache | None = None, past_key_values: Cache | None = None,
                inputs_embeds: Tensor | None = None, use_cache: bool | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, cache_position: Tensor | None = None, **kwargs):
        self._check_inputs(input_ids, inputs_embeds, attention_mask)
        h_BTD, hidden_states, cache = self._stream(
            input_ids, inputs_embeds, attention_mask, position_ids,
            cache if cache is not None else past_key_values, use_cache, output_attentions, output_hidden_states,
            cache_position)
        return self._output(BaseModelOutputWithPast(last_hidden_state=h_BTD, hidden_states=hidden_states,
                                                    **{CACHE_FIELD: cache}), return_dict)


class GbattnForCausalLM(GbattnPreTrainedModel, GenerationMixin):
    """gbattn's GPT behind the transformers causal-LM interface (README, "Hugging Face transformers").

    ``forward(input_ids | inputs_embeds, attention_mask, position_ids, cache | past_key_values, labels, use_cache,
    logits_to_keep, output_hidden_states)``: ``attention_mask`` (B, past + T) is 1 for real tokens (left padding
    works); positions come from ``position_ids``, else ``cumsum(attention_mask) - 1``, else ``cache_position``,
    else past..past+T-1.
    ``labels`` are the input ids (-100 = ignored), shifted here: the loss is gbattn's
    ``self.model(input_ids[:, :-1], input_ids[:, 1:])``; with ``num_items_in_batch`` (transformers 5's ``Trainer``)
    it is the summed cross-entropy divided by that count. ``hidden_states``: n_layers + 1 tensors, each block's
    input (the embeddings first) and the final norm's output, which the head reads.
    ``gradient_checkpointing_enable()`` recomputes each block in the backward pass.
    """

    # Trainer's count of an optimizer step's labels: transformers 5 counts the shifted ones (the targets), 4.x every
    # label, a row's first too, which no position predicts: its count divided the summed loss by T/(T-1) too much
    # (loss, gradients and eval_loss ~6% low at T=16). Under 4.x each batch's own mean is the loss, gbattn's.
    accepts_loss_kwargs = TF_MAJOR >= 5

    def generate(self, *args, **kwargs):
        """transformers' ``generate()``. Assisted decoding (a draft model, gbattn's or another with the same
        vocabulary, or prompt lookup) and chunked prefill (``prefill_chunk_size``) get a :class:`GbattnCache` made
        here: transformers makes none for this model (forward() does) and said "Assisted decoding requires a cache"
        or "Cannot use prefill chunking without a cache"; the draft tokens it rejects are cropped from it.
        Early-exit decoding (``assistant_early_exit``: the model's own first layers as its draft) is refused up
        front, whether asked for by keyword or by the generation config (given, or the model's own); so is a
        ``cache_implementation`` other than ``"dynamic"`` (transformers ignored it with a warning; ``"dynamic_full"``,
        which transformers 4.x gives a draft model, is one).
        Under transformers 4.x a chunked prefill of a left-padded batch is refused (4.x positions the
        chunks over the padded width)."""
        inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
        for name, value in (("input_ids", inputs), ("inputs_embeds", kwargs.get("inputs_embeds")),
                            ("attention_mask", kwargs.get("attention_mask"))):
            check_tensor(name, value)  # (a list was "'list' object has no attribute 'shape'" inside transformers)
        check_token_shapes(inputs, kwargs.get("inputs_embeds"))  # (a row of ids alone: an IndexError in transformers)
        # generate(inputs, generation_config, ...): a config given second counts as one given by keyword (it was
        # taken for none: every check below read the model's own, and chunked prefill got no cache)
        given = kwargs.get("generation_config") or (args[1] if len(args) > 1 else None)
        settings = self._merged_settings(given)
        if kwargs.get("assistant_early_exit", getattr(settings, "assistant_early_exit", None)) is not None:
            raise ValueError("GbattnForCausalLM does not support early-exit decoding (assistant_early_exit): its draft "
                             "would be the model's own first blocks; give a draft model (assistant_model) instead")
        stops = kwargs.get("stop_strings", getattr(settings, "stop_strings", None))
        if stops and kwargs.get("tokenizer") is not None and not _decodes_to_its_text(kwargs["tokenizer"]):
            raise ValueError("stop_strings need a tokenizer whose tokens decode back to their text (transformers "
                             "finds each token's text so); this one writes a space before each piece (the paper's "
                             "BPE has no decoder: its pieces are joined with spaces), and transformers failed with "
                             "'substring not found': stop on the end-of-text token, or use `gbattn generate --stop`")
        # (max_length from the generation config given, or else the model's own: an export's generation_config.json
        # may set one, and transformers 4.x's default of 20 is used too)
        embeds = kwargs.get("inputs_embeds")  # (a prompt given as embeddings: its length counts; none given:
        # transformers starts every row from the BOS token, a one-token prompt)
        prompt = width = inputs.shape[-1] if inputs is not None else embeds.shape[-2] if embeds is not None else 1
        mask = kwargs.get("attention_mask")
        if isinstance(mask, Tensor) and mask.dim() == 2 and mask.shape[-1] == prompt and mask.numel():
            # a left-padded row's positions count its own tokens (cumsum of its mask), not the padded width: a batch
            # padded to 24 with rows of 9 and 2 tokens was refused 3 new tokens it could take
            prompt = int(mask.ne(0).sum(-1).max())
        if TF_MAJOR < 5 and embeds is not None and embeds.shape[-2] == 1:  # (transformers' own; its Llama's too)
            raise ValueError("transformers 4.x's generate() feeds a one-token inputs_embeds prompt to the model again "
                             "at every step after the first, in place of the tokens it made: give input_ids, a "
                             "prompt of two or more embeddings, or use transformers >= 5")
        lookup = _integer(kwargs.get("prompt_lookup_num_tokens", getattr(settings, "prompt_lookup_num_tokens", None)))
        if (lookup and TF_MAJOR < 5
                and kwargs.get("eos_token_id", getattr(settings, "eos_token_id", None)) is None):
            # (a TypeError from torch.isin in transformers' candidate search, once a draft was found in the prompt)
            raise ValueError("transformers 4.x's prompt lookup (prompt_lookup_num_tokens) needs an end-of-text token "
                             "id, and this generation has none (eos_token_id is None, as in an export of gbattn's "
                             "char or paper BPE tokenizer): leave prompt lookup out, give a draft model "
                             "(assistant_model), or use transformers >= 5")
        max_new_tokens = kwargs.get("max_new_tokens", getattr(settings, "max_new_tokens", None))
        max_length = kwargs.get("max_length", getattr(settings, "max_length", None))
        try:
            self._check_length(prompt, width, max_new_tokens, max_length, lookup=lookup or 0)
        except ValueError:
            if not getattr(given, "is_assistant", False):
                raise
            # drafting for another library's model (transformers marks the config it gives a draft; a gbattn target
            # checks its draft up front): one drafting call's numbers, the whole generation's length unknown here
            block = self.config.max_position_embeddings
            raise ValueError(f"this model, drafting for another (assistant_model), has positions 0 .. {block - 1} "
                             f"(max_position_embeddings, gbattn's block_size), and the generation it drafts for has "
                             f"reached {prompt} tokens: keep that generation's prompt and new tokens within "
                             f"{block + 1} tokens, or give a draft with more positions") from None
        self._check_negative_prompt(kwargs, settings, prompt, width, max_new_tokens, max_length)
        draft = kwargs.get("assistant_model", getattr(settings, "assistant_model", None))
        if isinstance(draft, GbattnForCausalLM):  # its positions, checked before decoding starts (it failed midway,
            # with the numbers of transformers' drafting calls): it reads as many tokens as this model does
            try:
                draft._check_length(prompt, width, max_new_tokens, max_length)
            except ValueError as e:
                raise ValueError(f"the draft model (assistant_model) has fewer positions than this generation "
                                 f"needs: {e}") from None
        kind = kwargs.get("cache_implementation", getattr(settings, "cache_implementation", None))
        if kind == "dynamic_full" and TF_MAJOR < 5:
            # transformers 4.x's for a draft model (dynamic, with no sliding layers: GbattnCache is so), taken out of
            # what generate() gets, which warned that it "will be ignored" at every drafting call
            args, kwargs = self._without_cache_implementation(args, kwargs, given)
        elif kind not in (None, "dynamic"):  # (transformers ignored another, warning the model takes no Cache)
            raise ValueError(f"cache_implementation={kind!r}: GbattnForCausalLM keeps its keys and values in its own "
                             f"GbattnCache, which grows as a dynamic cache; leave cache_implementation unset")
        chunked = kwargs.get("prefill_chunk_size", getattr(settings, "prefill_chunk_size", None))
        use_cache = kwargs.get("use_cache", getattr(settings, "use_cache", True))
        if chunked and TF_MAJOR < 5 and self._padded_batch(inputs, kwargs, settings):
            raise ValueError("transformers 4.x's chunked prefill (prefill_chunk_size) gives every row of a left-padded "
                             "batch the positions 0, 1, ... of the padded width, not its own: leave prefill_chunk_size "
                             "unset for a padded batch, or use transformers >= 5")
        assisted = any(kwargs.get(k, getattr(settings, k, None)) is not None for k in ASSISTED)
        if ((chunked or assisted) and use_cache is not False
                and all(kwargs.get(k) is None for k in ("cache", "past_key_values"))):
            kwargs[CACHE_FIELD] = GbattnCache(len(self.model.blocks))
        return super().generate(*args, **kwargs)

    @staticmethod
    def _without_cache_implementation(args: tuple, kwargs: dict, given) -> tuple[tuple, dict]:
        """generate()'s arguments with no cache_implementation: none as a keyword, and a given GenerationConfig
        copied without it (the caller's own, transformers' draft settings, is left as it is)."""
        kwargs = {k: v for k, v in kwargs.items() if k != "cache_implementation"}
        if given is not None and getattr(given, "cache_implementation", None) is not None:
            given = copy.deepcopy(given)
            given.cache_implementation = None
            if "generation_config" in kwargs:
                kwargs["generation_config"] = given
            else:
                args = (args[0], given, *args[2:])
        return args, kwargs

    def _check_negative_prompt(self, kwargs: dict, settings, prompt: int, width: int, max_new_tokens,
                               max_length) -> None:
        """Guidance's negative prompt (``negative_prompt_ids``, with ``guidance_scale`` other than 1) is fed every new
        token as the prompt is: one longer than the prompt is checked as :meth:`_check_length` checks the prompt (it
        ran past the positions midway, "sequence length 33 exceeds block_size=32", the tokens so far lost)."""
        negative = kwargs.get("negative_prompt_ids")
        scale = kwargs.get("guidance_scale", getattr(settings, "guidance_scale", None))
        if not isinstance(negative, Tensor) or negative.dim() != 2 or scale is None or scale == 1:
            return
        mask = kwargs.get("negative_prompt_attention_mask")
        real = (int(mask.ne(0).sum(-1).max()) if isinstance(mask, Tensor) and mask.shape == negative.shape
                and mask.numel() else negative.shape[-1])
        if real <= prompt:
            return
        max_new_tokens, max_length = _integer(max_new_tokens), _integer(max_length)
        if max_new_tokens is None and (max_length is None or TF_MAJOR < 5 and max_length == DEFAULT_NEW_TOKENS
                                       and kwargs.get("max_length") is None):
            # neither set (transformers 4.x: its default max_length of 20): 20 new tokens, within the positions
            max_new_tokens = min(width + DEFAULT_NEW_TOKENS, self.config.max_position_embeddings) - width
        elif max_new_tokens is None:
            max_new_tokens = max_length - width  # (the new tokens max_length leaves, counted from the prompt's width)
        try:
            self._check_length(real, real, max_new_tokens, None)
        except ValueError as e:
            raise ValueError(f"guidance's negative prompt (negative_prompt_ids) is longer than the prompt and is fed "
                             f"every new token too: {e}") from None

    def _check_length(self, prompt: int, width: int, max_new_tokens, max_length, lookup: int = 0) -> None:
        """A generation of a ``prompt``-token prompt (its longest row; ``width``: the batch's padded width, which
        max_length counts) asked to run past the model's positions is refused before it starts (it stopped at the
        position past block_size with "position_ids reach N", the tokens so far lost). The last new token is never
        fed back, so a sequence may end one token past the positions. ``lookup``: prompt lookup's
        ``prompt_lookup_num_tokens``, whose drafted tokens transformers does not cut at max_length, only at the text
        so far: up to ``lookup`` - 1 positions past that end, and fewer than the text (measured)."""
        max_new_tokens, max_length = _integer(max_new_tokens), _integer(max_length)
        if max_new_tokens is not None:
            tokens = f"{prompt} token{'s' if prompt != 1 else ''}"
            asked, length = f"a prompt of {tokens} and max_new_tokens={max_new_tokens}", prompt + max_new_tokens
        elif max_length is not None:  # (new tokens past the padded width: a left-padded row's positions are its own)
            padded = f" over a batch padded to {width} (its longest row {prompt} tokens)" if width != prompt else ""
            asked, length = f"max_length={max_length}{padded}", prompt + max_length - width
        else:
            return
        block = self.config.max_position_embeddings

        def drafted_past(total: int) -> int:  # prompt lookup's drafted tokens past a generation of ``total`` tokens
            return min(max(lookup - 1, 0), max(total - 2, 0))

        drafted = drafted_past(length)
        if length - 1 + drafted > block:
            new = length - prompt  # (the new tokens asked for) and the most that fit, fewer drafted with fewer
            room = next((n for n in range(new - 1, 0, -1) if prompt + n - 1 + drafted_past(prompt + n) <= block), 0)
            more = f" (max_length={width + room})" if max_new_tokens is None else ""
            if room > 0:
                advice = f"ask for at most {room} new token{'s' if room != 1 else ''}{more}"
            elif drafted:
                advice = ("the prompt does not fit with prompt lookup's drafted tokens: a smaller "
                          "prompt_lookup_num_tokens")
            elif new <= block:  # (0 new tokens: refused anyway) the prompt's last tokens that leave room for them
                advice = f"the prompt does not fit: keep its last {block + 1 - new} tokens at most for {new} new"
            else:
                advice = f"the prompt does not fit, and at most {block} new tokens do after a 1-token prompt"
            lookup = (f" with prompt lookup's {drafted} drafted token{'s' if drafted != 1 else ''} past them "
                      f"(prompt_lookup_num_tokens={lookup})" if drafted else "")
            raise ValueError(f"{asked} feed the model positions 0 .. {length - 2 + drafted}{lookup}; it has 0 .. "
                             f"{block - 1} (max_position_embeddings, gbattn's block_size): {advice}")

    def _merged_settings(self, given):
        """The generation settings transformers decodes with: a given GenerationConfig's, each field it leaves at
        GenerationConfig's default taken from the model's own (as transformers merges them; the checks read the
        given one alone, and a model config's max_new_tokens=30 ran past the positions)."""
        if given is None:
            return self.generation_config
        merged, default = copy.deepcopy(given), GenerationConfig()
        for key, value in default.__dict__.items():
            if key.startswith("_") or key == "transformers_version":
                continue
            own = getattr(self.generation_config, key, value)
            if getattr(merged, key, value) == value and own != value:
                setattr(merged, key, own)
        return merged

    @staticmethod
    def _padded_batch(ids, kwargs: dict, settings) -> bool:
        """Whether generate() gets a padded batch: its attention_mask holds a 0, or, without one, the input ids
        ``ids`` hold pad_token_id (other than the end-of-text token), from which transformers makes the mask itself."""
        mask = kwargs.get("attention_mask")
        if mask is not None:
            return not bool(mask.all())
        pad = kwargs.get("pad_token_id", getattr(settings, "pad_token_id", None))
        eos = kwargs.get("eos_token_id", getattr(settings, "eos_token_id", None))
        if not isinstance(ids, Tensor) or pad is None:
            return False
        # an int, a list or a tensor, as transformers takes them (`pad in [tensor([2, 7])]` raised a RuntimeError)
        ends = torch.as_tensor(eos).flatten().tolist() if eos is not None else []
        pad = int(torch.as_tensor(pad))
        return pad not in ends and bool((ids == pad).any())

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        """generate() makes no DynamicCache: forward() makes a :class:`GbattnCache`."""
        return False

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, cache: Cache | None = None, past_key_values: Cache | None = None,
                inputs_embeds: Tensor | None = None, labels: Tensor | None = None, use_cache: bool | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, cache_position: Tensor | None = None,
                logits_to_keep: int | Tensor = 0, **kwargs):
        self._check_inputs(input_ids, inputs_embeds, attention_mask, labels)
        if not isinstance(logits_to_keep, Tensor):  # a count, numpy's integers included (np.int64(3) kept every logit)
            logits_to_keep = checked("logits_to_keep", logits_to_keep, int, lambda n: n >= 0,
                                     "0 (every position), the number of last positions to keep, or a tensor of "
                                     "positions")
        keeps_some = isinstance(logits_to_keep, Tensor) or logits_to_keep != 0
        if labels is not None and keeps_some:
            # The loss needs every position's logits (cross_entropy said "Expected input batch_size (0) to match ...").
            raise ValueError(f"labels need the logits of every position; logits_to_keep={logits_to_keep!r} keeps "
                             f"only some: leave it at 0 when passing labels")
        h_BTD, hidden_states, cache = self._stream(
            input_ids, inputs_embeds, attention_mask, position_ids,
            cache if cache is not None else past_key_values, use_cache, output_attentions, output_hidden_states,
            cache_position)
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            h_BTD = h_BTD[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, Tensor):
            h_BTD = h_BTD[:, logits_to_keep]
        logits_BTV = self.model.lm_head(h_BTD)

        loss = None
        if labels is not None:
            loss = shifted_loss(logits_BTV, labels.to(logits_BTV.device), kwargs.get("num_items_in_batch"))
        return self._output(CausalLMOutputWithPast(loss=loss, logits=logits_BTV, hidden_states=hidden_states,
                                                   **{CACHE_FIELD: cache}), return_dict)


ASSISTED = ("assistant_model", "prompt_lookup_num_tokens")  # generate()'s assisted decoding (early exit: refused)


def check_token_shapes(input_ids: Tensor | None, inputs_embeds: Tensor | None) -> None:
    """A ValueError unless the ids given are (batch, tokens) and the embeddings (batch, tokens, hidden_size)."""
    for name, value, dims in (("input_ids", input_ids, 2), ("inputs_embeds", inputs_embeds, 3)):
        if value is not None and value.dim() != dims:
            raise ValueError(f"{name} of shape {tuple(value.shape)}: expected (batch, tokens"
                             f"{', hidden_size' if dims == 3 else ''})")


def mark_initialised(gpt: GPT) -> GPT:
    """Flag every module and parameter as initialised, so transformers' init passes leave them alone."""
    for module in gpt.modules():
        module._is_hf_initialized = True
        for p in module.parameters(recurse=False):
            p._is_hf_initialized = True
    return gpt


def shifted_loss(logits_BTV: Tensor, labels_BT: Tensor, num_items_in_batch=None) -> Tensor:
    """Next-token cross-entropy of ``logits[:, t]`` against ``labels[:, t + 1]`` (-100 ignored): the
    mean, or the sum divided by ``num_items_in_batch`` (``Trainer`` with gradient accumulation)."""
    targets_N = labels_BT[:, 1:].flatten()
    total = lm_loss(logits_BTV[:, :-1], labels_BT[:, 1:], reduction="sum")
    if num_items_in_batch is None:
        num_items_in_batch = (targets_N != -100).sum().clamp_min(1)
    if isinstance(num_items_in_batch, Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _integer(value) -> int | None:
    """``value`` as an int where it is an integer of any kind (numpy's, a 0-d integer tensor: ``isinstance(v, int)``
    let ``np.int64(12)`` past the length check, and took ``torch.tensor(11)`` for no max_new_tokens), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, Tensor) and value.numel() == 1 and value.is_floating_point():
        value = value.item()
    if isinstance(value, float) and value.is_integer():  # (30.0, which transformers takes: the check skipped it)
        return int(value)
    try:
        return operator.index(value)
    except TypeError:
        return None


def _decodes_to_its_text(tokenizer, text: str = "abcdef") -> bool:
    """Whether ``tokenizer``'s tokens of ``text`` decode back to a string holding it, as transformers' stop-string
    criterion assumes of every tokenizer (it finds each token's text after the tokens of "abcdef")."""
    try:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return text in tokenizer.convert_tokens_to_string(tokenizer.convert_ids_to_tokens(ids))
    except Exception:  # (a tokenizer that cannot even do that fails in transformers' criterion too)
        return False
