"""The console's error line: the root cause of a chain, long lists shortened (lightning_parallel.cli.errors)."""

from hydra.errors import InstantiationException

from lightning_parallel.cli.errors import error_line, rank_error_file, read_rank_error, root_cause, short_message


def _raised_through_instantiate(cause):
    try:
        try:
            raise cause
        except Exception as inner:
            raise InstantiationException("Error in call to target 'lightning_parallel.adapters.HFCausalLM':") from inner
    except InstantiationException as outer:
        return outer


def test_the_cause_behind_hydras_instantiate_wrapper_is_shown():
    error = _raised_through_instantiate(ValueError("model.pretrained='/nonexistent' holds no config.json: give ..."))
    assert error_line(error) == "ValueError: model.pretrained='/nonexistent' holds no config.json: give ..."
    assert "Error in call to target" not in error_line(error)


def test_the_outermost_non_wrapper_wins_so_a_remedy_added_around_torchs_error_stays():
    try:
        try:
            raise RuntimeError("torch's inner error")
        except RuntimeError as inner:
            raise ValueError("the suite's message with the remedy") from inner
    except ValueError as error:
        assert str(root_cause(error)) == "the suite's message with the remedy"


def test_an_error_raised_while_handling_another_is_followed_unless_suppressed():
    try:
        try:
            raise KeyError("x")
        except KeyError:
            raise InstantiationException("Error in call to target 'x':")  # noqa: B904 - the implicit context
    except InstantiationException as error:
        assert isinstance(root_cause(error), KeyError)


def test_a_long_state_dict_mismatch_keeps_a_few_entries_and_counts_the_rest():
    missing = ", ".join(f'"layer.{i}.weight"' for i in range(30))
    sizes = "\n".join(f"\tsize mismatch for block.{i}.w: copying a param with shape torch.Size([4]) from checkpoint, "
                      f"the shape in current model is torch.Size([8])." for i in range(37))
    head = "Error(s) in loading state_dict for GPT:"
    error = RuntimeError(f"{head}\n\tMissing key(s) in state_dict: {missing}.\n{sizes}")
    text = short_message(error)
    lines = text.splitlines()
    assert lines[0] == "Error(s) in loading state_dict for GPT:"
    assert '"layer.0.weight", "layer.1.weight", "layer.2.weight", "layer.3.weight" and 26 more' in lines[1]
    assert sum("size mismatch for" in line for line in lines) == 4
    assert lines[-1].strip() == "... and 33 more size mismatches"
    assert len(lines) <= 8


def test_a_message_of_many_lines_is_cut_with_a_pointer_to_the_log():
    text = short_message(ValueError("\n".join(f"line {i}" for i in range(20))))
    assert text.splitlines()[-1] == "... (12 more lines in the log)"


def test_a_child_ranks_error_line_is_read_back_by_the_launcher(tmp_path):
    assert read_rank_error(tmp_path, 1) is None
    rank_error_file(tmp_path, 1).parent.mkdir()
    rank_error_file(tmp_path, 1).write_text("ValueError: bad\n")
    assert read_rank_error(tmp_path, 1) == "ValueError: bad"


def test_a_child_error_replaces_rank_zeros_when_rank_zero_only_saw_the_peer_leave(tmp_path):
    import time

    from lightning_parallel.cli.errors import earlier_rank_error

    rank_error_file(tmp_path, 1).parent.mkdir()
    rank_error_file(tmp_path, 1).write_text("ValueError: the cause\n")
    gone = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    found = earlier_rank_error(tmp_path, [1], time.time() - 60, gone)  # written later, but rank 0 saw a peer leave
    assert (found.rank, found.line) == (1, "ValueError: the cause")
    own = ValueError("rank 0's own mistake")
    assert earlier_rank_error(tmp_path, [1], time.time() - 60, own) is None  # the child failed after rank 0
    assert earlier_rank_error(tmp_path, [1], time.time() + 60, own).line == "ValueError: the cause"  # before
    assert earlier_rank_error(tmp_path, [2], time.time(), gone) is None  # no child left an error


def test_a_ranks_error_after_a_peer_died_is_a_consequence():
    from lightning_parallel.cli.errors import is_peer_gone

    assert is_peer_gone(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"))
    assert not is_peer_gone(ValueError("model.optimizer.lr=-1 is not a positive learning rate"))


def test_the_child_with_a_cause_of_its_own_is_shown_before_one_that_saw_a_peer_leave(tmp_path):
    import time

    from lightning_parallel.cli.errors import earlier_rank_error

    rank_error_file(tmp_path, 1).parent.mkdir()
    rank_error_file(tmp_path, 1).write_text("RuntimeError: [gloo] Connection closed by peer\n")
    rank_error_file(tmp_path, 2).write_text("ValueError: rank 2's cause\n")
    found = earlier_rank_error(tmp_path, [1, 2], time.time(), RuntimeError("gloo: Connection reset by peer"))
    assert (found.rank, found.line) == (2, "ValueError: rank 2's cause")
