"""gbattn models in Hugging Face transformers: ``import gbattn.hf`` registers the ``gbattn`` model
type with ``AutoConfig``, ``AutoModelForCausalLM`` and ``AutoModel`` (no ``trust_remote_code``), so a directory
written by ``gbattn export`` loads with the Auto classes. Needs ``pip install 'gbattn[transformers]'``;
a bare ``import gbattn`` never imports transformers.

* :class:`GbattnConfig`: gbattn's config.json under ``config.gbattn``, standard names as properties.
* :class:`GbattnForCausalLM`: gbattn's GPT as ``self.model``; ``generate()``, ``Trainer``, ``from_pretrained``.
* :class:`GbattnModel`: the same weights as a base model (``last_hidden_state``: the final norm's output).
* :class:`GbattnCache`: the cache ``generate()`` drives (every attention call's named K/V per layer).
* :func:`hf_tokenizer`, :func:`wrap_run`, :func:`export_run`: tokenizer, in-memory wrap, export.
"""

try:
    import transformers  # noqa: F401
except ModuleNotFoundError as e:  # (a bare "No module named 'transformers'" named no extra; [hf] is datasets)
    if e.name != "transformers":
        raise
    raise ModuleNotFoundError("gbattn.hf needs transformers, which is not installed: pip install "
                              "'gbattn[transformers]'", name="transformers") from None

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from gbattn.hf.configuration import GbattnConfig
from gbattn.hf.export import export_run, wrap_run
from gbattn.hf.modeling import GbattnCache, GbattnForCausalLM, GbattnModel
from gbattn.hf.tokenization import hf_tokenizer

AutoConfig.register(GbattnConfig.model_type, GbattnConfig, exist_ok=True)
AutoModelForCausalLM.register(GbattnConfig, GbattnForCausalLM, exist_ok=True)
AutoModel.register(GbattnConfig, GbattnModel, exist_ok=True)
# Trainer's label smoother (label_smoothing_factor) shifts the labels only for a class named in this
# table (register() does not add it): without the entry each position was trained on its own token.
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(GbattnConfig.model_type, GbattnForCausalLM.__name__)

__all__ = ["GbattnCache", "GbattnConfig", "GbattnForCausalLM", "GbattnModel", "export_run", "hf_tokenizer",
           "wrap_run"]
