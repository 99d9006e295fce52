"""fairseq-rope-average: exact mean, selection of the last N, refusal of mismatched
checkpoints, atomic writes, and a result that fairseq-generate loads."""

import argparse
import collections

import pytest
import torch
from support.checkpoints import make_checkpoint, random_params, stopped
from support.commands import REPO, run_cli

from fairseq_rope.checkpoints import DICTIONARIES, dictionary_fingerprint
from fairseq_rope_tools.checkpoints import average_checkpoints as avg


def test_exact_mean_of_explicit_list(tmp_path):
    paths = [make_checkpoint(tmp_path / f"c{i}.pt", random_params(i)) for i in range(3)]
    out = tmp_path / "avg.pt"
    avg.main(["--inputs", *map(str, paths), "--output", str(out)])
    result = torch.load(out)  # safe default loader: the allow-list covers the Namespace
    loaded = [torch.load(p)["model"] for p in paths]
    for name in ("encoder.w", "decoder.b"):
        expected = (sum(m[name].double() for m in loaded) / 3).float()
        assert result["model"][name].dtype == torch.float32
        assert torch.equal(result["model"][name], expected)
        assert not torch.equal(result["model"][name], loaded[0][name])
    assert torch.equal(result["model"]["encoder.version"], torch.tensor([3]))
    assert result["cfg"]["model"].arch == "transformer_rope_tiny"
    assert result["last_optimizer_state"] is None  # dropped unless --keep-optimizer-state


def test_half_precision_parameters_are_averaged_in_high_precision(tmp_path):
    a = {"w": torch.full((2,), 1000.0, dtype=torch.float16)}
    b = {"w": torch.full((2,), 1001.0, dtype=torch.float16)}
    make_checkpoint(tmp_path / "a.pt", a)
    make_checkpoint(tmp_path / "b.pt", b)
    avg.main(["--inputs", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--output", str(tmp_path / "o.pt")])
    w = torch.load(tmp_path / "o.pt")["model"]["w"]
    assert w.dtype == torch.float16
    assert torch.equal(w, torch.tensor([1000.5, 1000.5]).half())


def _constant_checkpoint(path, value):
    return make_checkpoint(path, {"w": torch.full((2, 2), float(value))})


def test_last_update_checkpoints_of_a_directory_with_upper_bound(tmp_path):
    for epoch, update in ((1, 100), (2, 200), (3, 300), (3, 400)):
        _constant_checkpoint(tmp_path / f"checkpoint_{epoch}_{update}.pt", update)
    _constant_checkpoint(tmp_path / "checkpoint_last.pt", -1)  # never selected
    _constant_checkpoint(tmp_path / "checkpoint3.pt", -1)      # an epoch checkpoint: not an update one
    out = tmp_path / "avg.pt"
    avg.main(["--inputs", str(tmp_path), "--num-update-checkpoints", "2", "--output", str(out)])
    assert torch.load(out)["model"]["w"][0, 0].item() == 350.0
    avg.main(["--inputs", str(tmp_path), "--num-update-checkpoints", "3", "--checkpoint-upper-bound", "300",
              "--output", str(out)])
    assert torch.load(out)["model"]["w"][0, 0].item() == 200.0


def test_last_epoch_checkpoints_and_too_few(tmp_path, capsys):
    for epoch in (1, 2, 3, 10):
        _constant_checkpoint(tmp_path / f"checkpoint{epoch}.pt", epoch)
    _constant_checkpoint(tmp_path / "checkpoint_10_5000.pt", -100)
    out = tmp_path / "avg.pt"
    avg.main(["--inputs", str(tmp_path), "--num-epoch-checkpoints", "2", "--output", str(out)])
    assert torch.load(out)["model"]["w"][0, 0].item() == 6.5  # epochs 10 and 3, sorted numerically
    message = stopped(["--inputs", str(tmp_path), "--num-epoch-checkpoints", "5", "--output", str(tmp_path / "x.pt")],
                      capsys)
    assert "found 4 epoch checkpoints" in message and "need 5" in message
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize("kind", ["shape", "names", "arch"])
def test_mismatched_checkpoints_are_refused_naming_the_file(tmp_path, kind, capsys):
    good = make_checkpoint(tmp_path / "good.pt", random_params(0))
    if kind == "shape":
        bad = make_checkpoint(tmp_path / "bad.pt", random_params(1, (("encoder.w", (4, 4)), ("decoder.b", (3,)))))
        expect = "encoder.w has shape (4, 4)"
    elif kind == "names":
        bad = make_checkpoint(tmp_path / "bad.pt", random_params(1, (("encoder.w", (4, 3)), ("decoder.bias", (3,)))))
        expect = "different parameter names"
    else:
        bad = make_checkpoint(tmp_path / "bad.pt", random_params(1), arch="transformer_tiny")
        expect = "architecture 'transformer_tiny'"
    out = tmp_path / "avg.pt"
    message = stopped(["--inputs", str(good), str(bad), "--output", str(out)], capsys)
    assert str(bad) in message and expect in message
    assert not out.exists()


def test_interrupted_write_leaves_no_output(tmp_path, monkeypatch):
    paths = [make_checkpoint(tmp_path / f"c{i}.pt", random_params(i)) for i in range(2)]
    real_save = torch.save

    def crash_halfway(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        f.truncate(f.tell() // 2)  # a partial file on disk, then the "crash"
        raise KeyboardInterrupt

    monkeypatch.setattr(avg.torch, "save", crash_halfway)
    out = tmp_path / "avg.pt"
    with pytest.raises(SystemExit, match="130"):  # Ctrl-C: one line, status 130
        avg.main(["--inputs", *map(str, paths), "--output", str(out)])
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c0.pt", "c1.pt"]  # no temporary left

    # an existing average survives a crashed rewrite untouched
    monkeypatch.setattr(avg.torch, "save", real_save)
    avg.main(["--inputs", str(paths[0]), "--output", str(out)])
    previous = out.read_bytes()
    monkeypatch.setattr(avg.torch, "save", crash_halfway)
    with pytest.raises(SystemExit, match="130"):  # Ctrl-C: one line, status 130
        avg.main(["--inputs", *map(str, paths), "--output", str(out)])
    assert out.read_bytes() == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["avg.pt", "c0.pt", "c1.pt"]


def test_unreadable_checkpoint_is_named(tmp_path, capsys):
    good = make_checkpoint(tmp_path / "good.pt", random_params(0))
    bad = tmp_path / "truncated.pt"
    bad.write_bytes(good.read_bytes()[:100])
    message = stopped(["--inputs", str(good), str(bad), "--output", str(tmp_path / "o.pt")], capsys)
    assert f"cannot load {bad}" in message


@pytest.mark.e2e
def test_average_of_trained_checkpoints_loads_in_fairseq_generate(tiny_data_bin, tmp_path):
    save = tmp_path / "ckpt"
    run_cli([
        "fairseq-train", tiny_data_bin / "data-bin", "--user-dir", REPO / "fairseq_rope",
        "--arch", "transformer_rope_tiny", "--share-all-embeddings", "--optimizer", "adam", "--lr", "1e-3",
        "--max-tokens", "1000", "--max-update", "6", "--save-interval-updates", "2", "--keep-interval-updates", "5",
        "--no-epoch-checkpoints", "--save-dir", save, "--cpu", "--num-workers", "0", "--log-format", "simple",
        "--criterion", "label_smoothed_cross_entropy", "--disable-validation",
    ])
    out = tmp_path / "avg.pt"
    run_cli(["fairseq-rope-average", "--inputs", save,
             "--num-update-checkpoints", "3", "--output", out])
    members = [torch.load(save / f"checkpoint_1_{u}.pt")["model"] for u in (2, 4, 6)]
    name = "encoder.layers.0.fc1.weight"
    expected = (sum(m[name].double() for m in members) / 3).to(members[0][name].dtype)
    assert torch.equal(torch.load(out)["model"][name], expected)
    gen = run_cli([
        "fairseq-generate", tiny_data_bin / "data-bin", "--user-dir", REPO / "fairseq_rope", "--path", out,
        "--gen-subset", "test", "--beam", "4", "--lenpen", "0.6", "--cpu", "--max-tokens", "2000",
    ])
    n_test = sum(1 for _ in open(tiny_data_bin / "test.en"))
    assert gen.stdout.count("\nH-") + gen.stdout.startswith("H-") == n_test
    assert "Generate test with beam=4" in gen.stdout


# --- refusals and interrupted or failed writes -------------------------------------------------

def _rope_checkpoint(path, seed, **options):
    """A checkpoint whose saved model configuration has RoPE options (defaults unless given)."""
    state = {
        "model": collections.OrderedDict(random_params(seed)),
        "cfg": {"model": argparse.Namespace(**{"arch": "transformer_rope_tiny", "encoder_embed_dim": 64,
                                               "encoder_attention_heads": 2, "dropout": 0.1, **options})},
        "optimizer_history": [{"num_updates": seed}],
        "last_optimizer_state": None,
    }
    torch.save(state, path)
    return path


@pytest.mark.parametrize("option, a, b", [
    ("rope_layout", "interleaved", "half"),
    ("rope_theta", 10000.0, 500.0),
    ("rope_fraction", 1.0, 0.5),
    ("rope_values", False, True),
    ("attention_kind", "softmax", "linear"),
    ("encoder_attention_heads", 2, 4),  # same shapes, other computation
])
def test_checkpoints_of_different_models_are_refused_naming_the_option(tmp_path, option, a, b, capsys):
    first = _rope_checkpoint(tmp_path / "a.pt", 0, **{option: a})
    second = _rope_checkpoint(tmp_path / "b.pt", 1, **{option: b})
    message = stopped(["--inputs", str(first), str(second), "--output", str(tmp_path / "avg.pt")], capsys)
    assert f"{second} has {option} {b!r}, but {first} has {a!r}" in message
    assert not (tmp_path / "avg.pt").exists()


def test_unset_option_equals_its_default_and_training_only_options_may_differ(tmp_path):
    first = _rope_checkpoint(tmp_path / "a.pt", 0)  # saved before rope_layout existed
    second = _rope_checkpoint(tmp_path / "b.pt", 1, rope_layout="interleaved", dropout=0.3)
    avg.main(["--inputs", str(first), str(second), "--output", str(tmp_path / "avg.pt")])
    assert (tmp_path / "avg.pt").exists()


def test_averaging_merges_the_recorded_training_lengths(tmp_path):
    early = _rope_checkpoint(tmp_path / "a.pt", 0, rope_trained_length=4, rope_trained_length_counts=[0, 2, 5, 1, 1])
    late = _rope_checkpoint(tmp_path / "b.pt", 1, rope_trained_length=3, rope_trained_length_counts=[0, 4, 9, 2])
    older = _rope_checkpoint(tmp_path / "c.pt", 2)  # saved before lengths were recorded
    avg.main(["--inputs", str(early), str(late), str(older), "--output", str(tmp_path / "avg.pt")])
    model_cfg = torch.load(tmp_path / "avg.pt", map_location="cpu", weights_only=False)["cfg"]["model"]
    assert model_cfg.rope_trained_length == 4
    assert model_cfg.rope_trained_length_counts == [0, 4, 9, 2, 1]


def test_a_file_that_is_not_a_checkpoint_is_named(tmp_path, capsys):
    good = make_checkpoint(tmp_path / "good.pt", random_params(0))
    text = tmp_path / "notes.txt"
    text.write_text("eeee\n" * 50)
    message = stopped(["--inputs", str(good), str(text), "--output", str(tmp_path / "o.pt")], capsys)
    assert f"cannot load {text}: not a checkpoint" in message


def test_an_input_that_is_a_symlink_to_the_output_is_refused(tmp_path, capsys):
    paths = [make_checkpoint(tmp_path / f"c{i}.pt", random_params(i)) for i in range(2)]
    link = tmp_path / "latest.pt"
    link.symlink_to(paths[1])
    before = paths[1].read_bytes()
    message = stopped(["--inputs", str(paths[0]), str(link), "--output", str(paths[1])], capsys, status=2)
    assert message == (f"--output {paths[1]} is --inputs {link}: the output would overwrite its own input; "
                       "give another output")
    assert paths[1].read_bytes() == before


def test_an_existing_output_it_did_not_write_is_kept_and_its_own_average_replaced(tmp_path, capsys):
    """A training's checkpoint given as --output (checkpoint_best.pt for checkpoint.avg5.pt, say)
    is not the average's to replace; an average it wrote before is (average.sh run again)."""
    paths = [make_checkpoint(tmp_path / f"c{i}.pt", random_params(i)) for i in range(3)]
    training_checkpoint = make_checkpoint(tmp_path / "checkpoint_best.pt", random_params(9))
    before = training_checkpoint.read_bytes()
    message = stopped(["--inputs", str(paths[0]), str(paths[1]), "--output", str(training_checkpoint)], capsys,
                      status=2)
    assert message == (f"--output {training_checkpoint} exists and is not an average fairseq-rope-average wrote: "
                       "give a new file, or remove it first if it may go")
    assert training_checkpoint.read_bytes() == before
    out = tmp_path / "avg.pt"
    avg.main(["--inputs", str(paths[0]), str(paths[1]), "--output", str(out)])
    avg.main(["--inputs", str(paths[1]), str(paths[2]), "--output", str(out)])
    assert torch.load(out, map_location="cpu", weights_only=False)[avg.AVERAGE_OF] == ["c1.pt", "c2.pt"]


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"),
                                   RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4160")])
def test_full_disk_is_one_line_with_the_path(tmp_path, monkeypatch, error, capsys):
    paths = [make_checkpoint(tmp_path / f"c{i}.pt", random_params(i)) for i in range(2)]

    def disk_full(obj, f, *args, **kwargs):
        f.write(b"\0" * 4096)
        raise error

    monkeypatch.setattr(avg.torch, "save", disk_full)
    out = tmp_path / "avg.pt"
    message = stopped(["--inputs", *map(str, paths), "--output", str(out)], capsys)
    assert f"no space left on device while writing {out}" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c0.pt", "c1.pt"]


# --- dictionaries ---------------------------------------------------------------------------------

def fingerprint(*words):
    """The fingerprint of a fairseq dictionary of ``words`` in this order."""
    from fairseq.data import Dictionary

    dictionary = Dictionary()
    for word in words:
        dictionary.add_symbol(word)
    return dictionary_fingerprint(dictionary)


def _with_dictionaries(path, source, target):
    """The checkpoint ``path``, recording its dictionaries as every checkpoint fairseq-train writes
    with the plugin does."""
    state = torch.load(path, weights_only=False)
    state[DICTIONARIES] = {"source": source, "target": target}
    torch.save(state, path)
    return path


def test_checkpoints_of_other_dictionaries_are_refused_naming_both(tmp_path, capsys):
    """The same words in another order: the same shapes and options, but each token id is another
    word in each model. Only what the checkpoints record tells them apart."""
    ours, reordered = fingerprint("Haus", "Katze"), fingerprint("Katze", "Haus")
    first = _with_dictionaries(_rope_checkpoint(tmp_path / "a.pt", 0), ours, ours)
    second = _with_dictionaries(_rope_checkpoint(tmp_path / "b.pt", 1), ours, reordered)
    message = stopped(["--inputs", str(first), str(second), "--output", str(tmp_path / "avg.pt")], capsys)
    assert message == (f"{second} was trained with another target dictionary than {first} (fingerprints "
                       f"{reordered[:12]} and {ours[:12]}): a token id means another token in each, so they cannot "
                       "be averaged; average the checkpoints of one training")
    assert not (tmp_path / "avg.pt").exists()


def test_checkpoints_that_record_no_dictionaries_are_averaged_with_those_that_do(tmp_path):
    """Checkpoints saved before the fingerprints were recorded: what they record is compared."""
    ours = fingerprint("Haus", "Katze")
    older = _rope_checkpoint(tmp_path / "a.pt", 0)
    paths = [older] + [_with_dictionaries(_rope_checkpoint(tmp_path / f"{name}.pt", seed), ours, ours)
                       for seed, name in ((1, "b"), (2, "c"))]
    avg.main(["--inputs", *map(str, paths), "--output", str(tmp_path / "avg.pt")])
    assert torch.load(tmp_path / "avg.pt")[DICTIONARIES] == {"source": ours, "target": ours}


# --- the output, checked before any work ----------------------------------------------------------

@pytest.mark.parametrize("output, message", [
    ("ckpt", "--output {output} is a directory: give the file to write the average to"),
    ("elsewhere", "--output {output} is a directory: give the file to write the average to"),
    ("notes.txt/avg.pt", "--output {output}: directory {tmp_path}/notes.txt is a file, not a directory: "
                         "give a directory"),
])
def test_an_output_that_cannot_be_written_is_refused_before_any_checkpoint_is_read(tmp_path, capsys, monkeypatch,
                                                                                    output, message):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "notes.txt").write_text("a file\n")
    for update in (1, 2):
        make_checkpoint(tmp_path / "ckpt" / f"checkpoint_1_{update}.pt", random_params(update))

    def not_read(path):
        raise AssertionError(f"{path} was read: the output is checked first")

    monkeypatch.setattr(avg, "load_checkpoint", not_read)
    output = tmp_path / output
    assert stopped(["--inputs", str(tmp_path / "ckpt"), "--num-update-checkpoints", "2", "--output", str(output)],
                   capsys, status=2) == message.format(output=output, tmp_path=tmp_path)


# --- torch's legacy format (before torch 1.6) -----------------------------------------------------

def test_a_checkpoint_in_torchs_legacy_format_is_averaged(tmp_path):
    current = make_checkpoint(tmp_path / "current.pt", random_params(0))
    legacy = tmp_path / "legacy.pt"
    torch.save(torch.load(make_checkpoint(tmp_path / "zip.pt", random_params(1))), legacy,
               _use_new_zipfile_serialization=False)
    avg.main(["--inputs", str(current), str(legacy), "--output", str(tmp_path / "avg.pt")])
    expected = (torch.load(current)["model"]["encoder.w"].double() + torch.load(legacy)["model"]["encoder.w"]) / 2
    assert torch.equal(torch.load(tmp_path / "avg.pt")["model"]["encoder.w"], expected.float())


def test_a_legacy_format_checkpoint_that_does_not_load_is_named_as_one(tmp_path, capsys):
    good = make_checkpoint(tmp_path / "good.pt", random_params(0))
    legacy = tmp_path / "legacy.pt"
    torch.save(torch.load(good), legacy, _use_new_zipfile_serialization=False)
    legacy.write_bytes(legacy.read_bytes()[:300])
    message = stopped(["--inputs", str(good), str(legacy), "--output", str(tmp_path / "o.pt")], capsys)
    assert message == (f"cannot load {legacy}: a checkpoint in torch's legacy format (saved before torch 1.6) that "
                       "does not load: truncated? Copy it again from where it was saved")


HANG_WHILE_WRITING = """
import sys, time, torch
from fairseq_rope_tools.checkpoints import average_checkpoints as avg
real_save = torch.save
def save_half_then_hang(obj, f, *args, **kwargs):
    real_save(obj, f, *args, **kwargs)
    f.truncate(f.tell() // 2)
    f.flush()
    print("WRITING", flush=True)
    # short sleeps: a signal that the kernel hands to one of torch's threads interrupts no sleep
    # of the main thread, which runs Python's handlers only when it wakes
    for _ in range(6000):
        time.sleep(0.1)
avg.torch.save = save_half_then_hang
avg.main(sys.argv[1:])
"""


def _average_until_writing(tmp_path, paths, out):
    import signal
    import subprocess
    import sys

    # A shell without job control starts background commands with SIGINT ignored, and Python
    # keeps an inherited SIG_IGN: restore the default so that the child's SIGINT is Ctrl-C's
    # KeyboardInterrupt however the test suite itself was started.
    proc = subprocess.Popen(
        [sys.executable, "-c", HANG_WHILE_WRITING,
         "--inputs", *map(str, paths), "--output", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline().strip() == "WRITING", proc.stderr.read()
    return proc


@pytest.mark.e2e
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_terminated_write_leaves_no_temporary_file(tmp_path, sig):
    import signal

    paths = [make_checkpoint(tmp_path / f"c{i}.pt", random_params(i)) for i in range(2)]
    out = tmp_path / "avg.pt"
    proc = _average_until_writing(tmp_path, paths, out)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # the partial exists
    proc.send_signal(getattr(signal, sig))
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c0.pt", "c1.pt"]


@pytest.mark.e2e
def test_partial_from_sigkill_is_never_taken_for_a_checkpoint(tmp_path):
    import signal

    for update in (10, 20):
        _constant_checkpoint(tmp_path / f"checkpoint_1_{update}.pt", update)
    out = tmp_path / "checkpoint_1_30.pt"  # the worst name for an output: a checkpoint's
    proc = _average_until_writing(tmp_path, [tmp_path / "checkpoint_1_10.pt", tmp_path / "checkpoint_1_20.pt"], out)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    partial = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(partial) == 1 and partial[0].name.startswith(".checkpoint_1_30.pt.") and not out.exists()
    # directory selection ignores it; the next write of that output removes it
    assert avg.last_n_checkpoints(str(tmp_path), 2, update_based=True) == [
        str(tmp_path / "checkpoint_1_20.pt"), str(tmp_path / "checkpoint_1_10.pt")]
    avg.main(["--inputs", str(tmp_path), "--num-update-checkpoints", "2", "--output", str(tmp_path / "avg.pt")])
    avg.main(["--inputs", str(tmp_path), "--num-update-checkpoints", "2", "--output", str(out)])
    assert not partial[0].exists() and torch.load(out)["model"]["w"][0, 0].item() == 15.0


def _with_task(path, data):
    """The checkpoint ``path``, its configuration naming the data-bin ``data`` (en -> de)."""
    state = torch.load(path, weights_only=False)
    state["cfg"]["task"] = argparse.Namespace(data=str(data), source_lang="en", target_lang="de")
    torch.save(state, path)
    return path


def test_checkpoints_that_record_no_dictionaries_are_compared_through_their_data_bin(tmp_path, capsys):
    """Checkpoints saved before the fingerprints were recorded (every one on disk until now): the
    dictionaries of the data-bin their configuration names are compared where they still are, and
    a warning names the inputs whose dictionaries cannot be known."""
    for name, words in (("ours", ("Haus", "Katze")), ("reordered", ("Katze", "Haus"))):
        (tmp_path / name).mkdir()
        for lang in ("en", "de"):
            (tmp_path / name / f"dict.{lang}.txt").write_text("".join(f"{w} 1\n" for w in words))
    first = _with_task(_rope_checkpoint(tmp_path / "a.pt", 0), tmp_path / "ours")
    other = _with_task(_rope_checkpoint(tmp_path / "b.pt", 1), tmp_path / "reordered")
    assert "was trained with another source dictionary" in stopped(
        ["--inputs", str(first), str(other), "--output", str(tmp_path / "avg.pt")], capsys)
    same = _with_task(_rope_checkpoint(tmp_path / "c.pt", 2), tmp_path / "ours")
    avg.main(["--inputs", str(first), str(same), "--output", str(tmp_path / "avg.pt")])
    assert torch.load(tmp_path / "avg.pt")[DICTIONARIES]["source"] == fingerprint("Haus", "Katze")
    assert "warning" not in capsys.readouterr().err
    gone = _with_task(_rope_checkpoint(tmp_path / "d.pt", 3), tmp_path / "deleted")
    avg.main(["--inputs", str(first), str(gone), "--output", str(tmp_path / "avg.pt")])
    err = capsys.readouterr().err
    assert f"warning: {gone} record no dictionaries" in err and "are not compared" in err
