"""``--help`` of the four commands: a description, examples, the config groups or options, the docs to read.

``lp-train`` and ``lp-compare`` printed Hydra's stock "train is powered by Hydra" page; ``lp-plan`` and
``lp-convert`` printed their module docstrings with reStructuredText markup (````lp-plan````, ``:func:``).
:func:`plain` strips that markup; :func:`hydra_app_help` writes the page of a Hydra command, with its config
groups read from Hydra's config repository.
"""

from __future__ import annotations

import re
import textwrap

DOCS = "docs/index.md in the repository (a MkDocs site: mkdocs serve)"  # no published site address yet
_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj):`~?([^`]+)`")


def plain(text: str) -> str:
    """``text`` without reStructuredText markup: ````x```` -> ``x``, ``:func:`~a.b.c``` -> ``c``, ``::`` -> ``:``.

    Args:
        text: a docstring.
    """
    def role(match: re.Match) -> str:
        name = match.group(1)
        return name.rsplit(".", 1)[-1] if match.group(0).split("`")[1].startswith("~") else name

    text = _ROLE.sub(role, text)
    text = text.replace("``", "")
    return re.sub(r"(\S)::$", r"\1:", text, flags=re.M)


def _groups(config_dir: str) -> list[str]:
    """``group: option, option, ...`` lines of ``config_dir``, wrapped to 100 columns."""
    from lightning_parallel.cli.overrides_check import config_repository

    lines = []
    with config_repository(config_dir) as loader:
        for group in sorted(set(loader.list_groups("")) - {"hydra"}):
            options = ", ".join(loader.get_group_options(group))
            lines += textwrap.wrap(f"{group}: {options}", width=100, initial_indent="  ", subsequent_indent="    ")
    return lines


def hydra_app_help(prog: str, description: str, examples: list[tuple[str, str]], docs: str, config_dir: str) -> str:
    """The ``--help`` page of a Hydra command (``lp-train``, ``lp-compare``).

    Args:
        prog: the command's name.
        description: what it does (plain text, wrapped here).
        examples: ``(command line, what it shows)`` pairs.
        docs: the pages to read (repository paths).
        config_dir: the primary config folder (its groups are listed).
    """
    width = max(len(line) for line, _ in examples) + 2
    out = [f"usage: {prog} [GROUP=OPTION | KEY=VALUE ...] [-m] [--cfg job] [--hydra-help]", ""]
    out += textwrap.wrap(description, width=100)
    out += ["", "Examples:"] + [f"  {line.ljust(width)}# {what}" for line, what in examples]
    out += ["", "Config groups (pick with GROUP=OPTION; change a value with GROUP.KEY=VALUE; sweep with -m a,b):"]
    out += _groups(config_dir)
    out += ["", f"The composed config: {prog} ... --cfg job.  Hydra's own options: {prog} --hydra-help."]
    out += [f"Docs: {docs}.", f"Everything: {DOCS}."]
    return "\n".join(out)


TRAIN = dict(
    prog="lp-train",
    description=("Train a recipe (a LightningModule and its data) under any layout of data, pipeline, tensor, "
                 "context and expert parallelism, from the Hydra configs in conf/. Checks the config before any "
                 "process starts, starts the local ranks itself, writes one folder per run (outputs/<date>/<run>) "
                 "with its checkpoints, TensorBoard logs and metrics.json."),
    examples=[("lp-train trainer.max_steps=40", "the GPT recipe on 2 CPU processes, 40 steps"),
              ("lp-train strategy=hybrid trainer.devices=4", "data x pipeline 2 x tensor 2 on 4 processes"),
              ("lp-train resume=outputs/<date>/<run>", "continue a stopped run where it left off")],
    docs="docs/getting-started.md, docs/configs.md, docs/strategies.md",
)
COMPARE = dict(
    prog="lp-compare",
    description=("Run one experiment under several layouts on the same global batch and compare the losses and "
                 "gradients step by step with the first layout; exits 1 when a layout is beyond "
                 "compare.tolerance, 2 for a configuration error. Layouts are conf/strategy/ names with a device "
                 "count (pipeline:2) or sizes (dp2xcp2, cp4:ulysses, dp2xep2)."),
    examples=[("lp-compare compare.layouts='[single:1,pipeline:2]'", "pipeline 2 against one process"),
              ("lp-compare compare.layouts='[single:1,dp2,tp2]' compare.steps=5", "data 2, tensor 2"),
              ("lp-compare model=gpt_moe compare.layouts='[single:1,dp2xep2]'", "experts over 2 ranks")],
    docs="docs/comparing-layouts.md",
)
