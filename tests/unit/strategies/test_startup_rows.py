"""The start-up table says which engine holds the data axis, in what units, and whether blocks are compiled."""

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.strategies.hybrid.startup_rows import layout_rows


def test_zero_0_alone_is_reported_as_ddp_and_beside_tensor_parallelism_as_fsdp2():
    alone = layout_rows(ParallelOptions(data_parallel_size=2), ParallelLayout(2, 2, 1, 1), "32-true")
    assert "torch DDP, plain tensors" in alone["data"] and "data axis (DDP)" in alone["precision"]
    beside = layout_rows(ParallelOptions(data_parallel_size=2, tensor_parallel_size=2), ParallelLayout(4, 2, 1, 2),
                         "32-true")
    assert "FSDP2" in beside["data"] and "data axis (FSDP2)" in beside["precision"]


def test_compiled_blocks_get_a_row_naming_the_backend():
    rows = layout_rows(ParallelOptions(data_parallel_size=1, compile=True), ParallelLayout(1, 1, 1, 1), "32-true")
    assert rows["compile"] == "torch.compile per layer, backend inductor"
    assert "compile" not in layout_rows(ParallelOptions(data_parallel_size=1), ParallelLayout(1, 1, 1, 1), "32-true")


def test_zero_2_units_of_layers_are_named_in_the_data_row():
    units = layout_rows(ParallelOptions(data_parallel_size=2, zero_stage=2, bucket_size_mb=25),
                        ParallelLayout(2, 2, 1, 1), "32-true")
    assert units["data"] == "FSDP2: gradients + optimizer state sharded; layers grouped into units of up to 25 MB"
    per_layer = layout_rows(ParallelOptions(data_parallel_size=2, zero_stage=2), ParallelLayout(2, 2, 1, 1), "32-true")
    assert "units" not in per_layer["data"]
