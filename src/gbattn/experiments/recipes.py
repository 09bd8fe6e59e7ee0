"""Named comparison recipes: which models, at which preset, on which data, with which seeds.

The recipes follow the comparison rules of docs/baselines.md: the same data, tokenizer, steps,
batch, schedule and seeds for every model; a parameter-matched standard baseline for the mechanism
that adds parameters; and a compute-matched standard row (trained for as many FLOPs as GBA used).
Where a recipe carries fewer baselines (``cpu-baselines``, ``depth``, the design studies beyond GBA M=2,
``upcycle``), docs/baselines.md says so, and ``compare --matched LABEL`` adds them.
The CPU recipes name their data as a Hugging Face name (``wikitext-2-v1``) or the corpus shipped
with gbattn (``tiny-shakespeare``); ``--data DIR`` points them at a local copy (README, "Data").
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from gbattn.checks import check_choice
from gbattn.errors import ConfigError


@dataclass
class ModelSpec:
    label: str
    attn: str = "standard"
    attn_options: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)  # model-config overrides (norm, residual, ...)
    param_matched_to: str | None = None  # solve d_model: smallest standard width >= that model's parameters
    compute_matched_to: str | None = None  # train for as many FLOPs as that model (more steps)
    init_from: str | None = None  # continue from that model's trained weights (fresh optimizer and schedule) ...
    upcycle: dict | None = None  # ... upcycled first to this attention: {"attn": "boosted", "attn_options": {...}}
    steps_share: float | None = None  # this share of the run's max_steps (after --set: a split budget stays split)


@dataclass
class Recipe:
    name: str
    description: str
    preset: str
    models: list[ModelSpec]
    seeds: list[int] = field(default_factory=lambda: [42])
    default_data: str | None = None
    train: dict = field(default_factory=dict)  # training overrides on top of the preset's recipe
    published: dict = field(default_factory=dict)  # label -> published perplexity (mean, std or None)
    published_source: str = ""


GBA = dict(attn="boosted", attn_options={"rounds": 2})


def paper_models() -> list[ModelSpec]:
    """The paper's table: standard, twicing, parameter-matched standard, GBA M=2, plus the
    compute-matched standard row (listed in display order; see :func:`training_order`)."""
    return [
        ModelSpec("standard"),
        ModelSpec("twicing", attn="twicing"),
        ModelSpec("param-fair", param_matched_to="gba-m2"),
        ModelSpec("compute-matched", compute_matched_to="gba-m2"),
        ModelSpec("gba-m2", **GBA),
    ]


def training_order(specs: list[ModelSpec]) -> list[ModelSpec]:
    """The order runs start in: a model always after the ones it starts from or is matched to, and before that
    display order, except that the models others wait for come first, the longest chain of waiting models first,
    so that ``--jobs`` does not leave a job idle while a compute-matched run waits for its reference."""
    ready_order: list[ModelSpec] = []
    waiting = list(specs)
    while waiting:
        ready = [s for s in waiting if all(d not in {w.label for w in waiting} for d in depends_on(s))]
        if not ready:
            raise ConfigError(f"models {[s.label for s in waiting]} depend on each other")
        ready_order += ready
        waiting = [s for s in waiting if s not in ready]
    chain: dict[str, int] = {}  # how many models wait, one after another, for this one's result
    for spec in reversed(ready_order):
        chain[spec.label] = max((chain[s.label] + 1 for s in specs if spec.label in depends_on(s)), default=0)
    return sorted(specs, key=lambda s: -chain[s.label])  # stable: display order among equal chains


def depends_on(spec: ModelSpec) -> list[str]:
    """The models whose results ``spec`` needs before it can train."""
    return [label for label in (spec.compute_matched_to, spec.init_from) if label]


RECIPES: dict[str, Recipe] = {}


def _add(recipe: Recipe) -> None:
    RECIPES[recipe.name] = recipe


CPU_STEPS = dict(max_steps=1200, eval_every=300)  # the cpu-proxy budget: 4.9M tokens, about 75 minutes on 2 cores
POST_LN = {"norm": "post"}


def postln_models() -> list[ModelSpec]:
    return [
        ModelSpec("standard-postln", model=POST_LN),
        ModelSpec("param-fair-postln", model=POST_LN, param_matched_to="gba-m2-postln"),
        ModelSpec("compute-matched-postln", model=POST_LN, compute_matched_to="gba-m2-postln"),
        ModelSpec("gba-m2-postln", model=POST_LN, **GBA),
    ]


def depth_models() -> list[ModelSpec]:
    """Does GBA (inside a layer) combine with AttnRes (across layers)? docs/baselines.md."""
    block = {"residual": "attnres-block"}
    return [
        ModelSpec("standard"),
        ModelSpec("standard-attnres", model=block),
        ModelSpec("compute-matched", compute_matched_to="gba-m2"),
        ModelSpec("gba-m2", **GBA),
        ModelSpec("gba-m2-attnres", model=block, **GBA),
    ]


def design_models() -> list[ModelSpec]:
    """Which GBA configuration earns its FLOPs? Each row changes one option of GBA M=2 (kv_source
    residual, linear gate, every layer); param-fair and compute-matched are matched to GBA M=2."""

    def gba(label: str, **options) -> ModelSpec:
        return ModelSpec(label, attn="boosted", attn_options={"rounds": 2, **options})

    return [
        ModelSpec("standard"),
        ModelSpec("param-fair", param_matched_to="gba-m2"),
        ModelSpec("compute-matched", compute_matched_to="gba-m2"),
        gba("gba-m2"),
        gba("gba-kv-input", kv_source="input"),
        gba("gba-kv-shared", kv_source="shared"),
        gba("gba-m3", rounds=3),
        gba("gba-gate-vector", gate="vector"),
        gba("gba-gate-scalar", gate="scalar"),
        gba("gba-upper-half", layers=[2, 3]),
    ]


def baseline_models() -> list[ModelSpec]:
    """Every attention mechanism in scope on the same data and seeds: standard, Twicing, gated (G1), differential
    (with the block's biases, and without attention biases as its authors have it) and GBA M=2 (docs/baselines.md)."""
    return [
        ModelSpec("standard"),
        ModelSpec("twicing", attn="twicing"),
        ModelSpec("gated", attn="gated"),
        ModelSpec("differential", attn="differential"),
        ModelSpec("differential-no-attn-bias", attn="differential", model={"attn_bias": False}),
        ModelSpec("gba-m2", **GBA),
    ]


def best_design_models() -> list[ModelSpec]:
    """The design study's two best GBA configurations (M=2 and M=3) with standard, param-fair and
    compute-matched (README, "GBA design study")."""
    return [m for m in design_models() if m.label in ("standard", "param-fair", "compute-matched", "gba-m2", "gba-m3")]


def upcycle_models() -> list[ModelSpec]:
    """Add GBA rounds to a trained standard model (docs/method.md, "Upcycling"): a standard model trained
    for half the budget, then continued for the other half as itself, as upcycled GBA (residual and
    shared K/V), and as itself for GBA's continuation FLOPs; and GBA trained from scratch for all of it."""
    return [
        ModelSpec("base", steps_share=0.5),
        ModelSpec("standard-continued", init_from="base", steps_share=0.5),
        ModelSpec("gba-upcycled", init_from="base", upcycle=dict(attn="boosted", attn_options={"rounds": 2}),
                  steps_share=0.5),
        ModelSpec("gba-shared-upcycled", init_from="base", steps_share=0.5,
                  upcycle=dict(attn="boosted", attn_options={"rounds": 2, "kv_source": "shared", "gate": "tanh"})),
        ModelSpec("standard-continued-compute-matched", init_from="base", compute_matched_to="gba-upcycled",
                  steps_share=0.5),
        ModelSpec("gba-scratch", **GBA),
        ModelSpec("standard-scratch"),
    ]


# -- GPU scale: the paper's tables ---------------------------------------------------------------

_add(Recipe(
    name="paper-wt103",
    description="the paper's table: standard, twicing, param-fair, compute-matched and GBA M=2 at paper-small on "
                "10M WikiText-103 tokens, 15 epochs",
    preset="paper-small",
    models=paper_models(),
    seeds=[42, 123],
    default_data="wikitext-103-raw-v1",
    published={"standard": (72.2, 0.3), "twicing": (69.6, 0.1), "param-fair": (69.0, 0.1), "gba-m2": (67.9, 0.1)},
    published_source="arXiv 2604.03190, WikiText-103 (10M tokens), test perplexity, mean ± population std "
                     "(numpy's np.std, as the authors' script computes it; the rows above: sample std) over 2 seeds",
))
_add(Recipe(
    name="paper-owt",
    description="the same five models on 10M OpenWebText tokens",
    preset="paper-small",
    models=paper_models(),
    seeds=[42, 123],
    default_data="openwebtext",
    published={"standard": (114.94, 0.55), "twicing": (110.71, 0.28), "param-fair": (110.21, 0.48),
               "gba-m2": (108.54, 0.89)},
    published_source="arXiv 2604.03190, OpenWebText (10M tokens), test perplexity, 2 seeds",
))
_add(Recipe(
    name="paper-postln",
    description="Post-LN standard, param-fair, compute-matched and GBA M=2, and standard and GBA M=2 with AttnRes "
                "(does GBA need Pre-LN's additive residual stream?)",
    preset="paper-small",
    models=postln_models() + [
        # The third residual stream: attention over depth (Pre-LN sublayers, docs/baselines.md).
        ModelSpec("standard-attnres", model={"residual": "attnres-block"}),
        ModelSpec("gba-m2-attnres", model={"residual": "attnres-block"}, **GBA),
    ],
    seeds=[42],
    default_data="wikitext-103-raw-v1",
    published={"standard-postln": (77.20, None), "gba-m2-postln": (84.60, None), "param-fair-postln": (71.81, None)},
    published_source="arXiv 2604.03190, WikiText-103 small, Post-LN, 1 seed",
))
_add(Recipe(
    name="gba-design-paper",
    description="the design study's two best GBA configurations (M=2 and M=3) at paper-small, against standard, "
                "param-fair and compute-matched, 15 epochs",
    preset="paper-small",
    models=best_design_models(),
    seeds=[42, 123, 7],
    default_data="wikitext-103-raw-v1",
))
_add(Recipe(
    name="depth-paper",
    description="the depth recipe at paper-small on 10M WikiText-103 tokens (GPU scale)",
    preset="paper-small",
    models=depth_models(),
    seeds=[42, 123],
    default_data="wikitext-103-raw-v1",
))

# -- CPU proxies -------------------------------------------------------------------------------


def longer(base: Recipe, name: str, steps: int, description: str, seeds: list[int]) -> Recipe:
    """A training-length recipe: ``base``'s models but Twicing, trained for ``steps`` with ``base``'s schedule
    stretched over them (the cosine follows max_steps), for ``seeds`` (README, "Training length")."""
    return Recipe(name=name, description=description, preset=base.preset,
                  models=[m for m in base.models if m.label != "twicing"], seeds=seeds,
                  default_data=base.default_data, train=dict(base.train, max_steps=steps))


def cpu_recipe(name: str, description: str, models: list[ModelSpec], preset: str = "cpu-proxy") -> Recipe:
    """A CPU recipe on WikiText-2 (BPE 4,096) at the cpu-proxy budget (:data:`CPU_STEPS`), seed 42."""
    return Recipe(name=name, description=description, preset=preset, models=models, default_data="wikitext-2-v1",
                  train=dict(CPU_STEPS))


_add(cpu_recipe(
    "cpu-proxy",
    "the paper-wt103 models at the cpu-proxy preset on WikiText-2, 1,200 steps (about 75 minutes on 2 CPU cores)",
    paper_models(),
))
_add(cpu_recipe(
    "cpu-modern",
    "the cpu-proxy models in a Llama-style block (cpu-llama: RMSNorm, SwiGLU, RoPE, no biases, 2 K/V heads) on "
    "WikiText-2, 1,200 steps",
    paper_models(),
    preset="cpu-llama",
))
_add(cpu_recipe(
    "gba-design-proxy",
    "the two best GBA configurations of gba-design (M=2 and M=3, residual K/V, linear gate) at cpu-proxy on "
    "WikiText-2, 1,200 steps, against standard, param-fair and compute-matched",
    best_design_models(),
))
_add(longer(
    RECIPES["cpu-proxy"], "cpu-proxy-long", 2 * CPU_STEPS["max_steps"],
    "training length on WikiText-2: cpu-proxy's standard, param-fair, compute-matched and GBA M=2 at 2,400 steps "
    "(2x cpu-proxy, the same schedule stretched)",
    seeds=[42, 123, 7],
))
_add(cpu_recipe(
    "upcycle",
    "upcycling at cpu-proxy on WikiText-2: standard for 600 steps, then 600 more as standard, upcycled GBA (residual "
    "and shared K/V) or standard for GBA's FLOPs; GBA and standard from scratch for 1,200",
    upcycle_models(),
))
_add(cpu_recipe(
    "cpu-postln",
    "Post-LN standard, param-fair, compute-matched and GBA M=2 at cpu-proxy on WikiText-2 (same steps as cpu-proxy)",
    postln_models(),
))
_add(cpu_recipe(
    "depth",
    "standard and GBA M=2, each with plain and AttnRes-block residuals, and standard compute-matched to GBA M=2, at "
    "cpu-proxy on WikiText-2",
    depth_models(),
))
_add(Recipe(
    name="cpu-char",
    description="the paper-wt103 models, character-level tiny-shakespeare at nanoGPT's CPU configuration (2,000 steps)",
    preset="cpu-char",
    models=paper_models(),
    default_data="tiny-shakespeare",
    published={"standard": (6.55, None)},
    published_source="nanoGPT README (shakespeare_char on CPU): validation loss ~1.88 = perplexity ~6.55 for standard",
))
_add(longer(
    RECIPES["cpu-char"], "cpu-char-long", 8000,
    "training length: cpu-char's standard, param-fair, compute-matched and GBA M=2 at 8,000 steps (4x cpu-char, "
    "the same schedule stretched)",
    seeds=[42, 123, 7],
))
_add(Recipe(
    name="cpu-baselines",
    description="every attention mechanism at cpu-char (2,000 steps): standard, Twicing, gated, differential "
                "(with and without attention biases) and GBA M=2",
    preset="cpu-char",
    models=baseline_models(),
    seeds=[42, 123, 7],
    default_data="tiny-shakespeare",
))
_add(Recipe(
    name="gba-design",
    description="GBA design study at cpu-char (2,000 steps): kv_source, rounds, gate and which layers, "
                "against standard, param-fair and compute-matched",
    preset="cpu-char",
    models=design_models(),
    seeds=[42, 123, 7],
    default_data="tiny-shakespeare",
))


LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a folder name in the comparison
# What a comparison's folder holds beside its models' folders (results, its record, `gbattn plot`'s default --out):
# a model of such a label wrote its seed folders into them, or they over its folder
COMPARISON_ENTRIES = ("results.json", "results.md", "recipe.json", "figures")


def added_models_problem(models, matched, models_key: str = "models") -> str | None:
    """What is wrong with a recorded ``compare --model`` mapping and ``--matched`` list (recipe.json's ``models``,
    results.json's ``added``, named by ``models_key``), or None: both are untrusted input."""
    if not isinstance(models, dict) or not all(isinstance(v, str) for v in models.values()):
        return f"{models_key}={models!r} must map labels to variants"
    if not isinstance(matched, list) or not all(isinstance(label, str) for label in matched):
        return f"matched={matched!r} must be a list of labels"
    return None


def with_models(recipe: Recipe, models: dict[str, str], matched: list[str]) -> Recipe:
    """``recipe`` with models of the user's own (``compare --model LABEL=SPEC``, SPEC as ``bench --attn`` takes it)
    and, for each label in ``matched``, its two baselines (docs/baselines.md, "Comparison rules"):
    ``param-fair-LABEL``, standard attention widened to at least that model's parameters, and
    ``compute-matched-LABEL``, standard attention trained for that model's training FLOPs, both with that model's
    other fields (norm, residual stream, block, sizes)."""
    from gbattn.config import variant_spec  # (it imports torch; the recipes alone stay light for `--help`)

    taken = {spec.label for spec in recipe.models}
    folders = {label.lower(): label for label in taken}  # (one folder where case is not told apart: macOS, Windows)
    added: list[ModelSpec] = []
    for label, text in models.items():
        if not LABEL.fullmatch(label):
            raise ConfigError(f"--model {label}={text}: a label is a folder name: letters, digits, '.', '_' and '-', "
                              f"starting with a letter or digit, at most 64 characters")
        if label in taken:
            raise ConfigError(f"--model {label}={text}: recipe {recipe.name!r} has a model {label!r} already; "
                              f"choose another label")
        if label.lower() in folders:  # Standard beside standard: one folder where case is not told apart
            raise ConfigError(f"--model {label}={text}: differs from model {folders[label.lower()]!r} only in case, "
                              f"and a case-insensitive file system (macOS, Windows) keeps both runs in one folder; "
                              f"choose another label")
        if label.lower() in COMPARISON_ENTRIES:  # (results.json: every later call failed, "Not a directory")
            raise ConfigError(f"--model {label}={text}: {label} is a file or folder of the comparison itself "
                              f"({', '.join(COMPARISON_ENTRIES)}); choose another label")
        try:
            name, attn_options, model = variant_spec(text)
        except ConfigError as e:
            raise ConfigError(f"--model {label}={e}") from None
        added.append(ModelSpec(label, attn=name, attn_options=attn_options, model=model))
        taken.add(label)
        folders[label.lower()] = label
    for label in matched:
        target = next((spec for spec in [*recipe.models, *added] if spec.label == label), None)
        if target is None:
            raise ConfigError(f"--matched {label}: no such model in recipe {recipe.name!r} or --model "
                              f"({', '.join(sorted(taken))})")
        if target.init_from is not None:  # (its parameters were counted before the upcycle, its FLOPs of the
            # continuation alone: a "param-fair" baseline smaller than it, stated as matched)
            raise ConfigError(f"--matched {label}: it continues {target.init_from}'s trained weights; baselines are "
                              f"matched to a model trained from scratch (the recipe's own baselines of {label} are "
                              f"its references)")
        reference = target.param_matched_to or target.compute_matched_to
        if reference is not None:  # (its param-fair was sized from the model it is matched to, not from it, and
            # trained its recipe's steps, not its matched steps; its compute-matched took another warmup)
            raise ConfigError(f"--matched {label}: it is itself a baseline matched to {reference}; a baseline of "
                              f"a baseline is standard attention matched to standard attention (match {reference} "
                              f"instead; a comparison whose recipe.json records it was built before this check, "
                              f"its baselines of {label} wrong: start it again in another --out)")
        # (param-fair trains as many steps as its model: upcycle's base trains half the budget; compute-matched's
        # steps come from the model's FLOPs)
        for baseline in (ModelSpec(f"param-fair-{label}", model=dict(target.model), param_matched_to=label,
                                   steps_share=target.steps_share),
                         ModelSpec(f"compute-matched-{label}", model=dict(target.model), compute_matched_to=label)):
            if baseline.label in taken:
                raise ConfigError(f"--matched {label}: its baseline's label {baseline.label!r} is taken; give the "
                                  f"model another label")
            added.append(baseline)
            taken.add(baseline.label)
    return dataclasses.replace(recipe, models=[*recipe.models, *added]) if added else recipe


def get_recipe(name: str) -> Recipe:
    check_choice("recipe", name, tuple(RECIPES))
    return RECIPES[name]
