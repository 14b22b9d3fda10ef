"""Progress lines for long steps: fed by ninja's own [N/M] counts, one line per tenth off a terminal."""
from edgepack.progress import StepProgress, parse_step


def test_parse_ninja_steps():
    assert parse_step("[12/407] Building CXX object src/CMakeFiles/ncnn.dir/layer/x86/conv.cpp.o") == (12, 407)
    assert parse_step("-- Build files have been written") is None
    assert parse_step("  [1/2] indented is not ninja's") is None


def test_off_a_terminal_one_line_per_tenth():
    lines = []
    with StepProgress("building libncnn", lines.append, terminal=False) as p:
        for i in range(1, 401):
            p.feed(f"[{i}/400] Building CXX object x{i}.o\n")
            p.feed("noise without a count\n")
    assert len(lines) == 10
    assert lines[0] == "building libncnn: 40/400 steps (10%)" and lines[-1] == "building libncnn: 400/400 steps (100%)"


def test_steps_of_targets_built_side_by_side_share_one_live_display():
    # rich allows one live display at a time: a second bar of its own would raise LiveError
    from edgepack.progress import _SharedBar
    with StepProgress("libncnn x86_64", terminal=True) as a, StepProgress("libncnn aarch64", terminal=True) as b:
        a.update(1, 4)
        b.update(3, 4)
        assert _SharedBar.users == 2 and len(_SharedBar.bar.tasks) == 2
    assert _SharedBar.bar is None and _SharedBar.users == 0
