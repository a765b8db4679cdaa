from mtpkit.bench import packed_attention


def test_bench_times_both_forms_on_the_same_inputs(capsys):
    argv = ["--seq", "96", "--batch", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--doc-lengths",
            "10,96", "--block", "16", "--dtype", "float32", "--repeats", "2"]
    assert packed_attention.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["10", "96"]
    assert all(float(r[4]) < 1e-5 for r in rows)  # the same outputs
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)
