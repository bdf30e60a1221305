"""Every file under conf/ composes with the main config, and its objects can be built."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_parallel.cli.train import CONFIG_DIR, layout_of, world_size_of

GROUPS = sorted(p.name for p in Path(CONFIG_DIR).iterdir() if p.is_dir() and not p.name.startswith("hydra"))
OPTIONS = [(group, f.stem) for group in GROUPS for f in sorted((Path(CONFIG_DIR) / group).glob("*.yaml"))]


# Options that read the user's own files (docs/your-data.md): without them they must say which setting to give.
NEEDS_USERS_FILES = {("data", "hf_text"): "needs a tokenizer: set model.pretrained=DIR",
                     ("data", "image_folder"): "needs your folder: data.path="}


def _compose(overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        # ${hydra:runtime.output_dir} needs a running app: point the output folder elsewhere.
        return compose("config", overrides=[*overrides, "paths.output_dir=/tmp/lp-compose-test"])


def test_every_group_has_options():
    assert {"strategy", "experiment", "model", "data", "trainer", "scaling", "logger"} <= set(GROUPS)


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}/{o}" for g, o in OPTIONS])
def test_option_composes_and_resolves(group, option):
    # cluster is not a Hydra group: cluster descriptions the planner reads (strategy.cluster, lp-plan --cluster)
    if group == "cluster":
        from lightning_parallel.planner.cluster import load_cluster

        assert load_cluster(option, Path(CONFIG_DIR)).devices_per_node >= 1
        return
    if group == "hparams_search":
        pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="pip install -e '.[sweep]'")
    if (group, option) in (("strategy", "torchrec"), ("experiment", "recsys_torchrec")):
        pytest.importorskip("torchrec", reason="pip install -e '.[recsys]' && pip install --no-deps torchrec")
    # compare/ is not in lp-train's defaults (lp-compare adds it), so it composes as an addition.
    cfg = _compose([f"{'+' if group == 'compare' else ''}{group}={option}"])
    container = OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    assert container["trainer"]["_target_"] == "lightning.pytorch.Trainer"
    if group == "strategy":
        strategy = cfg.strategy if isinstance(cfg.strategy, str) else instantiate(cfg.strategy)
        layout = layout_of(strategy, world_size_of(cfg))
        assert layout.world_size == world_size_of(cfg)
    if (group, option) in NEEDS_USERS_FILES:  # built from the user's own folder: refused by name without one
        with pytest.raises(Exception, match=NEEDS_USERS_FILES[group, option]):
            instantiate(cfg[group])
    elif group in ("model", "data"):
        assert instantiate(cfg[group]) is not None
