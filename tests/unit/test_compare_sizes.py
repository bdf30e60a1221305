"""``lp-compare`` entries spelled by their sizes (``dp2xcp2``, ``cp4:ulysses``): parsed, labelled, composed."""

from __future__ import annotations

import pytest

from lightning_parallel.cli.compare import parse_layout, parse_sizes
from lightning_parallel.cli.preflight import ConfigError


def test_sizes_entries_fill_the_missing_axes_with_one_and_run_on_their_product() -> None:
    entry = parse_sizes("dp2xcp2")
    assert entry.sizes == {"dp": 2, "cp": 2, "pp": 1, "tp": 1, "ep": 1} and entry.devices == 4
    assert entry.label == "dp2xcp2xpp1xtp1:ring"
    assert parse_sizes(" tp2xcp2:ulysses ").label == "dp1xcp2xpp1xtp2:ulysses"
    assert parse_sizes("dp1xcp1xpp2xtp1").label == "dp1xcp1xpp2xtp1"  # no method without a context axis
    assert parse_sizes("cp4:ulysses").overrides() == [
        "strategy.data_parallel_size=1", "strategy.context_parallel_size=4", "strategy.pipeline_parallel_size=1",
        "strategy.tensor_parallel_size=1", "strategy.expert_parallel_size=1", "strategy.context_parallel_method=ulysses"]


def test_the_expert_axis_is_spelled_ep_borrows_data_ranks_and_shows_in_the_label() -> None:
    entry = parse_sizes("dp2xep2")
    assert entry.devices == 2 and entry.label == "dp2xcp1xpp1xtp1xep2"
    assert "strategy.expert_parallel_size=2" in entry.overrides()
    assert parse_sizes("dp2xcp2xep4").devices == 4
    with pytest.raises(ConfigError, match="must divide"):
        parse_sizes("dp2xep4")


def test_strategy_names_are_not_sizes_and_bad_sizes_say_how_to_spell_them() -> None:
    for name in ("pipeline:2", "hybrid:4", "context:2", "single:1"):
        assert parse_sizes(name) is None
    assert parse_layout("context:2") == ("context", 2)
    for bad, words in (("cp2xcp2", "at most once"), ("cp0", ">= 1"), ("cp2:flash", "one of ('ring', 'ulysses')")):
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            parse_sizes(bad)
    with pytest.raises(ConfigError, match="nor sizes"):
        parse_layout("cp")


def test_a_sizes_entry_composes_into_the_hybrid_strategy_with_a_context_axis(tmp_path) -> None:
    from hydra import initialize_config_dir
    from hydra.utils import instantiate

    from lightning_parallel.cli.compare import compose_layout
    from lightning_parallel.cli.preflight import layout_of
    from lightning_parallel.cli.run_folder import register_resolver
    from lightning_parallel.runtime.config_dir import CONFIG_DIR

    register_resolver()
    entry = parse_sizes("dp2xcp2:ulysses")
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose_layout("hybrid", entry.devices, ["model=gpt_tiny", "strategy.zero_stage=2"], str(tmp_path),
                             entry.overrides())
    strategy = instantiate(cfg.strategy)
    layout = layout_of(strategy, 4)
    assert (layout.data_parallel, layout.context_parallel, layout.pipeline_parallel, layout.tensor_parallel) == (
        2, 2, 1, 1)
    assert strategy.options.context_parallel_method == "ulysses" and strategy.options.zero_stage == 2
