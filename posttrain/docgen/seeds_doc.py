"""Render ``docs/seeds.md``: one row per method row (category a) of the seed catalog, with what implements it.

The seed papers (``../shared/papers/000_*.txt`` and ``004_*.txt``, one abstract a line) were catalogued in
``../shared/methods/catalog-part*.md``; its 79 category-(a) rows are methods a post-training library should
carry. Which of them the library carries is read from the code, so the table cannot drift: a registry entry
(of any registry: estimators, losses, drivers, selectors, rewards, ...) implements the seed lines its docstring
cites as ``papers/FILE.txt:LINE``; a recipe stands for a row when it selects one of the row's entries or its
comments cite the line (``papers/FILE.txt:LINE``, ``catalog 3.N`` or ``catalog LNNN``). A few parts live outside
the registries (a trainer, the asynchronous pipeline): :data:`PARTS` names them and their docstrings are read
the same way. A row that nothing cites needs a reason in :data:`NOTES`, the one hand-kept table.

The catalog lives outside the repository and a clean clone has no ``../shared``: the rows are kept here
(:data:`ROWS`, read once from the catalog by :func:`rows_from_catalog`); ``python -m posttrain.docgen.seeds_doc``
checks them against the catalog when it is there. ``tests/docgen/test_seeds_doc.py`` fails when the page is
stale, names an entry or recipe that does not exist, or has a row with neither an entry nor a reason.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from posttrain.algorithms import advantages
from posttrain.algorithms.registry import Registry
from posttrain.config import load_config, read_recipe
from posttrain.config.checks import chosen_entries, driver_registry, selector_registry
from posttrain.docgen.catalog import REGISTRIES
from posttrain.envs import ENVS
from posttrain.envs.tool_parsers import PARSERS
from posttrain.prepare.providers import PROVIDERS

ROOT = Path(__file__).resolve().parents[2]
CATALOG = ROOT.parent / "shared" / "methods"  # absent on a clean clone: only the generator reads it
REGENERATE = "python -m posttrain.docgen.seeds_doc > docs/seeds.md"
SEED_FILES = {"000": "000_99b2b1db2eead048.txt", "004": "004_f298e9ec572f7f27.txt"}
STATUSES = ("loop", "partial", "blocked", "withdrawn", "not built")

# (seed line, the catalog's short name, its catalog section: part 1's "3.N", part 2's "LNNN"), the catalog's
# category-(a) rows (part 2's "c + a" included) in its order. Regenerate with `python -m posttrain.docgen.seeds_doc
# --rows` where ../shared exists.
ROWS: tuple[tuple[str, str, str], ...] = (
    ("000:3", 'HINT (Meta-Hints + AAPO, "Affinity")', "3.1"),
    ("000:7", "TRAAC", "3.2"),
    ("000:9", "Noisy-verifier corrections (backward / forward)", "3.3"),
    ("000:11", "ReST-RL (ReST-GRPO + VM-MCTS)", "3.4"),
    ("000:13", "RLSF", "3.5"),
    ("000:17", "AsyncFlow", "3.6"),
    ("000:19", "Logit averaging with frozen reference (no KL)", "3.7"),
    ("004:3", "VERL (Velocity-Exploiting Rank-Learning)", "3.8"),
    ("004:5", "A\\*-PO", "3.9"),
    ("004:7", "RL-PLUS", "3.10"),
    ("004:9", "Progress advantage (implicit step PRM)", "3.11"),
    ("004:13", 'Entropy-based advantage ("Reasoning with Exploration")', "3.12"),
    ("004:25", "MAPO (Mixed Advantage PO)", "3.13"),
    ("004:27", "Teacher-forcing-induced step reward (text generation)", "3.14"),
    ("004:29", "HA-DW", "3.15"),
    ("004:31", "A-LoL (Advantage-Leftover Lunch)", "3.16"),
    ("004:33", "Dr.Kernel / KernelGYM: TRLOO, PR, PRS", "3.17"),
    ("004:35", "Pass@k Training", "3.18"),
    ("004:39", "CANON", "3.19"),
    ("004:45", "AAPO (Advantage momentum)", "3.20"),
    ("004:51", "Advantage Model + Selective Rehearsal", "3.21"),
    ("004:57", "NGRPO", "3.22"),
    ("004:63", "SPAE", "3.23"),
    ("004:67", "QAE (Quantile Advantage Estimation)", "3.24"),
    ("004:75", "LENS", "3.25"),
    ("004:79", "RL^V", "3.26"),
    ("004:85", "FiMi-RM", "3.27"),
    ("004:89", "PACED-RL", "3.28"),
    ("004:93", "PAR (Preference As Reward)", "3.29"),
    ("004:95", "DDCA (DCA)", "3.30"),
    ("004:99", "A3PO", "3.31"),
    ("004:101", "DigiRL", "3.32"),
    ("004:105", "Bilevel SFT–RL cooperation", "3.33"),
    ("004:111", "DRPO (Decoupled Reward PO)", "3.34"),
    ("004:113", "CAPO (Curriculum Advantage PO)", "3.35"),
    ("004:115", "ProGRPO (ARM, Advantage Re-weighting Mechanism)", "3.36"),
    ("004:117", "GD²PO (and GDPO baseline)", "3.37"),
    ("004:123", "RoRecomp (Rollout Response Recomposition)", "L123"),
    ("004:125", "ODIN: length-disentangled two-head reward model", "L125"),
    ("004:127", "Guide / Guide-GRPO (adaptive hints)", "L127"),
    ("004:131", "CPL (Contrastive Preference Learning)", "L131"),
    ("004:133", "RLRR + Ranking Reward Model", "L133"),
    ("004:135", "ArenaRL (tournament ranking)", "L135"),
    ("004:137", "MARS (multi-agent self-play)", "L137"),
    ("004:139", "Shuffle-R1 (PTS + ABS)", "L139"),
    ("004:141", "RAPID", "L141"),
    ("004:143", "RLCR (calibration reward)", "L143"),
    ("004:147", "IRL imitation (inverse soft-Q as TD-regularized MLE)", "L147"),
    ("004:149", "Clip / Delta PRM reward refinement", "L149"),
    ("004:151", "Reward design with LMs (prompted LLM as proxy reward)", "L151"),
    ("004:159", "Turn-PPO", "L159"),
    ("004:161", "A-GRAE (asymmetric group-relative advantage)", "L161"),
    ("004:163", "TP-GRPO (thought-level GenPRM rewards)", "L163"),
    ("004:165", "F-GRPO (focal weighting)", "L165"),
    ("004:169", "Two-stage RLVR dynamics; GRPO-N (negative-only)", "L169"),
    ("004:177", "ROSE (semantic-entropy branching + segment advantage)", "L177"),
    ("004:179", "f-GRPO / f-HAL", "L179"),
    ("004:181", "CROPI (off-policy influence curriculum)", "L181"),
    ("004:185", "RC-GRPO (reward-conditioned GRPO)", "L185"),
    ("004:187", "Stop Regressing (HL-Gauss value classification)", "L187"),
    ("004:189", "LamPO (pairwise decomposed advantage)", "L189"),
    ("004:195", "CRM / CRF (conciseness reward model + function)", "L195"),
    ("004:197", "RGRA (REINFORCE with group-relative advantage)", "L197"),
    ("004:203", "INPO (iterative Nash policy optimization)", "L203"),
    ("004:205", "Ra-DPO (risk-aware DPO)", "L205"),
    ("004:207", "Semi-online RL (UI-S1)", "L207"),
    ("004:211", "ARRoL (online rollout pruning)", "L211"),
    ("004:215", "1-shot RLVR", "L215"),
    ("004:217", "APA (Advantage-Induced Policy Alignment)", "L217"),
    ("004:219", "AEnt (clamped entropy, adaptive coefficient)", "L219"),
    ("004:221", "HiPER / HAE (hierarchical advantage estimation)", "L221"),
    ("004:223", "RLTR (transferable reward)", "L223"),
    ("004:225", "SCOPE-RL (scaffolded + process-shape rewards)", "L225"),
    ("004:227", "ROVER (random-policy valuation)", "L227"),
    ("004:229", "Tree-OPO (staged GRPO on MCTS prefixes)", "L229"),
    ("004:231", "Teaching LLMs to reason with RL (EI vs PPO)", "L231"),
    ("004:237", "ARPO (entropy-adaptive branching for tool agents)", "L237"),
    ("004:239", "ShiQ (Shifted-Q)", "L239"),
    ("004:241", "ORPO: occupancy-measure χ² regularization (Laidlaw et al.)", "L241"),
)


@dataclass(frozen=True)
class Note:
    """Why a row is not simply ``loop``: its status and, in a few words, what is missing (issues 37 and 38)."""

    status: str  # partial | blocked | withdrawn | not built (a row with entries and no note is "loop")
    why: str


_TODO = "not built yet (issue 37 item 1)"
# The hand-kept table. A "not built" / "blocked" / "withdrawn" row must have no entry (the test says so: once an
# entry cites the line, drop its note or make it "partial"); a "partial" row may have entries or none.
NOTES: dict[str, Note] = {
    "000:7": Note("partial", "the length reward is built; the attention-based rollout compression is not (issue 38)"),
    "000:9": Note("partial", "the appeals estimate of the false-negative rate is not built (issue 38, D1)"),
    "000:11": Note("partial", "ReST-GRPO's filter is built; the value-model MCTS decoding is not (issue 38)"),
    "000:13": Note("not built", f"{_TODO}: the segment-level reward from a second model's feedback"),
    "004:3": Note("partial", "the effective-rank metrics are diagnostics (`posttrain/diagnostics/rank.py`); the "
                  "advantage shaping from the rank dynamics is not built (issue 38)"),
    "004:9": Note("partial", "the step scorer is built; best-of-N selection, uncertainty and failure attribution "
                  "are not (issue 38)"),
    "004:27": Note("partial", "the induced step reward is built (tf_reward, provisional: the soft-Q reading "
                             "r_t = f(a_t|s_t) - logsumexp f(.|s_{t+1})); the paper's stabiliser for non-parallel data "
                             "is not"),
    "004:33": Note("partial", "TRLOO is built; its multi-turn setting (and the profiling reward, PRS) is not "
                   "(issue 38)"),
    "004:51": Note("not built", f"{_TODO}: a second model predicting advantages, selective rehearsal"),
    "004:63": Note("not built", f"{_TODO}: the training code is unreleased and the advantage's coefficients are not "
                                "given (catalog 3.23); the probe needs sampling at each step inside the loop"),
    "004:79": Note("not built", f"{_TODO}: a second model (the verifier) trained beside the policy"),
    "004:89": Note("not built", f"{_TODO}: needs a GFlowNet (trajectory-balance) objective with a learned log Z(x), "
                                "which the library lacks"),
    "004:99": Note("partial", "the advantage is built; its schedule is blocked on the paper's text (issue 38)"),
    "004:101": Note("not built", _TODO),
    "004:105": Note("not built", _TODO),
    "004:133": Note("partial", "the rank transform is built; the listwise ranking reward model is not (issue 38)"),
    "004:135": Note("not built", f"{_TODO}: the pairwise-judge tournament"),
    "004:137": Note("partial", "one agent only: no self-play or two-role environment gives agent_ids other than 0 "
                    "(issue 38, D9)"),
    "004:141": Note("partial", "large batches and off-policy minibatches run (`train.minibatches`, the behaviour "
                    "corrections); the sequence-level truncated importance weight is no entry with a recipe yet "
                    "(issue 38)"),
    "004:147": Note("partial", "offline IQ-Learn as TD-regularized MLE is built (sft.loss = \"iq_learn\"), "
                               "provisional: IQ-Learn's chi^2 form, the paper's coef and gamma not recovered; the "
                               "online and GAIL variants are not"),
    "004:163": Note("not built", f"{_TODO}: a generative PRM's thought-level rewards"),
    "004:177": Note("not built", f"{_TODO}: a tree of prefixes"),
    "004:179": Note("partial", "f-GRPO is built, provisional (a third-party rendering of its formula, issue 37 "
                    "item 2); f-HAL, the hybrid on/off-policy objective, is not"),
    "004:181": Note("not built", _TODO),
    "004:189": Note("withdrawn", "the arXiv paper was withdrawn; no formula to build from"),
    "004:195": Note("partial", "the CRF is built, provisional (reward crf: the reviews' form R[1 + a c (s + d_q)]; a, "
                              "the annealing of s and d_q are not pinned: s is a constant, d_q an example field); the "
                              "CRM is posttrain rm on (concise, redundant) pairs, a Bradley-Terry ranker, not the "
                              "paper's pointwise fine-tune on a 72B judge's scores"),
    "004:207": Note("partial", "the step and episode advantages are built, library only (the loop computes no "
                    "`expert_match`); the patch module is not (issue 38)"),
    "004:211": Note("not built", f"{_TODO}: a learned quality head that prunes rollouts"),
    "004:221": Note("partial", "the advantage is built, library only (the loop computes no turn values at two "
                    "levels); the plan/execute hierarchy is not (issue 38)"),
    "004:223": Note("not built", f"{_TODO}: a receiver model continuing a truncated prefix"),
    "004:225": Note("not built", _TODO),
    "004:229": Note("not built", f"{_TODO}: MCTS prefixes"),
    "004:237": Note("not built", f"{_TODO}: branching after tool calls"),
    "004:239": Note("partial", "ShiQ is built, provisional: the loss is rebuilt from the paper's three steps (no code "
                               "released); beta = 0.1 is not the paper's value"),
    "004:241": Note("not built", f"{_TODO}: a discriminator for the occupancy measure"),
}

# Parts outside the registries that implement a seed row (their docstrings cite it like an entry's), and which
# merged recipes select them.
PARTS: dict[str, Callable[[dict], bool]] = {
    "posttrain.produce.pipeline.RolloutPipeline": lambda d: int(d.get("rollout", {}).get("max_staleness", 0)) > 0,
    "posttrain.algorithms.reward_modeling.odin_loss": lambda d: d.get("rm", {}).get("debias") == "odin",
    "posttrain.trainers.rm_heads.FiMi": lambda d: d.get("rm", {}).get("debias") == "fimi",
    "posttrain.trainers.rft.rft": lambda d: "rft" in d,
}

_SEED_REF = re.compile(r"(000_99b2b1db2eead048|004_f298e9ec572f7f27)\.txt: ?(\d+)")
_CATALOG_REF = re.compile(r"catalog (L\d+|3\.\d+)\b")


def kinds() -> dict[str, Registry]:
    """Every registry, by the short kind the table names it with (``driver:hint_reroll``)."""
    return {**REGISTRIES, "driver": driver_registry()[0], "batch_selector": selector_registry(),
            "provider": PROVIDERS, "env": ENVS, "tool_parser": PARSERS}


def seed_lines(text: str) -> set[str]:
    """The seed lines (``"004:31"``) that ``text`` cites as ``papers/FILE.txt:LINE``."""
    return {f"{m.group(1)[:3]}:{m.group(2)}" for m in _SEED_REF.finditer(text)}


def part(dotted: str) -> object:
    """The object a :data:`PARTS` name stands for (``ImportError`` / ``AttributeError`` when it is gone)."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


@cache
def entries_by_line() -> dict[str, tuple[str, ...]]:
    """Seed line -> the entries (``kind:name``) and parts whose docstrings cite it."""
    out: dict[str, list[str]] = {}
    for kind, reg in kinds().items():
        for name in reg.names():
            for line in seed_lines(reg.doc(name)):
                out.setdefault(line, []).append(f"{kind}:{name}")
    for dotted in PARTS:
        for line in seed_lines(inspect.getdoc(part(dotted)) or ""):
            out.setdefault(line, []).append(dotted)
    return {k: tuple(sorted(v)) for k, v in out.items()}


def _comments(path: Path) -> str:
    return "\n".join(line[line.index("#"):] for line in path.read_text().splitlines() if "#" in line)


def _selected(path: Path, data: dict) -> set[str]:
    """Entries (``kind:name``) and parts a merged recipe selects. A DPO recipe selects only its preference
    loss; an SFT recipe (one naming ``sft.loss``) only that loss; a reward-model or RFT recipe none of the RL parts
    it inherits from ``tiny.toml`` (not its method).
    """
    out = {dotted for dotted, selects in PARTS.items() if selects(data)}
    if "dpo" in data:
        return out | {f"preference:{data['dpo'].get('loss', 'dpo')}"}
    if "rm" in data or "rft" in data:
        return out
    if "loss" in data.get("sft", {}):  # an SFT recipe (posttrain sft): only its SFT loss is its method
        return out | {f"sft_loss:{data['sft']['loss']}"}
    label = {id(reg): kind for kind, reg in kinds().items()}
    cfg = load_config(path, [])
    out |= {f"{label[id(c.registry)]}:{c.name}" for c in chosen_entries(cfg)}
    if advantages.REGISTRY.traits(cfg.algorithm.advantage).needs_critic:
        out.add(f"value_head:{cfg.critic.head}")
    return out


@cache
def recipes_by_line() -> dict[str, tuple[str, ...]]:
    """Seed line -> the preset recipes that select one of its entries or whose comments cite it."""
    by_section = {section: line for line, _, section in ROWS}
    wanted = entries_by_line()
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / "recipes").glob("*.toml")):
        rel = path.relative_to(ROOT).as_posix()
        text = _comments(path)
        cited = seed_lines(text) | {by_section[s] for s in _CATALOG_REF.findall(text) if s in by_section}
        chosen = _selected(path, read_recipe(path))
        cited |= {line for line, entries in wanted.items() if chosen & set(entries)}
        for line in cited:
            out.setdefault(line, set()).add(rel)
    return {k: tuple(sorted(v)) for k, v in out.items()}


@dataclass(frozen=True)
class Row:
    """One table row, as the code has it."""

    line: str
    name: str
    status: str  # one of STATUSES, or "unexplained" (no entry, no note: the test fails)
    entries: tuple[str, ...]
    recipes: tuple[str, ...]
    why: str


def unexplained() -> list[str]:
    """The rows (``"004:31 (A-LoL ...)"``) that no entry cites and no note explains."""
    return [f"{line} ({name})" for line, name, _ in ROWS if line not in entries_by_line() and line not in NOTES]


def table_rows() -> list[Row]:
    """Every row of :data:`ROWS` with its entries, recipes and status (see the module docstring)."""
    rows = []
    for line, name, _ in ROWS:
        entries = entries_by_line().get(line, ())
        note = NOTES.get(line)
        if note is not None:
            status, why = note.status, note.why
        else:
            status, why = ("loop", "") if entries else ("unexplained", "")
        rows.append(Row(line, name, status, entries, recipes_by_line().get(line, ()), why))
    return rows


def _cell(items: tuple[str, ...]) -> str:
    return ", ".join(f"`{i}`" for i in items) or "—"


def render() -> str:
    """The whole page; raises ``ValueError`` for a row with neither an entry nor a note."""
    bad = unexplained()
    if bad:
        raise ValueError(f"seed rows {bad}: no registry entry's docstring cites their papers/FILE.txt:LINE and "
                         "posttrain.docgen.seeds_doc.NOTES gives no reason; cite the line or add a note")
    rows = table_rows()
    counts = ", ".join(f"{sum(r.status == s for r in rows)} {s}" for s in STATUSES)
    files = " and ".join(f"`{f}`" for f in SEED_FILES.values())
    lines = [
        "# Seed methods: catalog row -> entries -> recipes", "",
        f"One row per method row (category a) of the seed catalog: a line of {files} "
        "(`000:13` is line 13 of the first), its short name in the catalog, and what implements it. "
        "**entries** are the registry entries (`kind:name`; `posttrain algorithms NAME` prints one) and the "
        "few parts outside the registries whose docstrings cite the line as `papers/FILE.txt:LINE`; "
        "**recipes** are the presets that select one of them or whose comments cite the line.",
        "Status: `loop` (entries usable from a recipe), `partial` (what is missing follows), `blocked` (on the "
        "paper's text), `withdrawn` (the paper), `not built`. The reasons are the hand-kept "
        "`posttrain.docgen.seeds_doc.NOTES`; everything else is read from the code.", "",
        f"{len(rows)} rows: {counts}.", "",
        f"This page is generated by `{REGENERATE}`; `tests/docgen/test_seeds_doc.py` fails when it is stale, "
        "names an entry or recipe that does not exist, or a row has neither an entry nor a reason.", "",
        "| seed | method | status | entries | recipes | why |", "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [f"`{r.line}`", r.name, f"`{r.status}`", _cell(r.entries), _cell(r.recipes), r.why or "—"]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def rows_from_catalog(directory: Path = CATALOG) -> list[tuple[str, str, str]]:
    """The category-(a) rows of ``catalog-part1.md`` (``| # | FILE: LINE | name | a | ...``, sections
    ``### 3.N ... (FILE: LINE)``) and ``catalog-part2.md`` (``| LINE | name | a or c + a | ...`` of file 004).
    """
    part1, part2 = ((directory / f"catalog-part{i}.md").read_text() for i in (1, 2))
    sections = {f"{f}:{n}": s for s, f, n in re.findall(r"^### (3\.\d+) .*\((\d{3})_\w+\.txt: ?(\d+)\)", part1, re.M)}
    rows = []
    for text in (part1, part2):
        for raw in re.findall(r"^\|\s*\d+\s*\|.*$", text, re.M):
            cells = [c.strip() for c in raw.strip().strip("|").split("|")]
            seed = re.fullmatch(r"(\d{3})_\w+\.txt: ?(\d+)", cells[1]) if len(cells) == 7 else None
            if seed and cells[3] == "a":
                line = f"{seed.group(1)}:{seed.group(2)}"
                rows.append((line, cells[2], sections.get(line, "")))
            elif len(cells) == 6 and "a" in cells[2].split(" + "):
                rows.append((f"004:{cells[0]}", cells[1], f"L{cells[0]}"))
    return rows


def main(argv: list[str]) -> int:
    """Print the page (or, with ``--rows``, the catalog's rows as :data:`ROWS`); where the catalog is here,
    refuse to print a page whose :data:`ROWS` differ from it.
    """
    if CATALOG.is_dir():
        found = rows_from_catalog()
        if "--rows" in argv or tuple(found) != ROWS:
            print("ROWS = (\n" + "".join(f"    {r!r},\n" for r in found) + ")", file=sys.stderr)
            return 0 if "--rows" in argv else 1
    print(render(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
