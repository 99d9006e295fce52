"""Concatenation training (``--task translation_concat``, fairseq_rope/tasks/translation_concat.py):
the joins are reproducible from the seed and the epoch and new every epoch, stay within the
maximum positions, join sources with sources and targets with targets; from stock fairseq-train
the task trains, leaves validation alone and records the training length of what the model saw."""

import numpy as np
import pytest
import torch
from support.commands import run_cli

from fairseq_rope.config_values import OptionError
from fairseq_rope.tasks.translation_concat import ConcatenatedPairsDataset


def pairs_dataset(pairs=200, seed=0, shuffle=True):
    """A LanguagePairDataset of random sentences of 1 to 12 tokens (+ EOS), as fairseq loads them."""
    from fairseq.data import Dictionary, LanguagePairDataset

    dictionary = Dictionary()
    for i in range(40):
        dictionary.add_symbol(f"w{i}")
    g = torch.Generator().manual_seed(seed)

    def sentences():
        out = []
        for _ in range(pairs):
            n = int(torch.randint(1, 13, (1,), generator=g))
            out.append(torch.cat([torch.randint(4, len(dictionary), (n,), generator=g),
                                  torch.tensor([dictionary.eos()])]))
        return out

    src, tgt = sentences(), sentences()
    return LanguagePairDataset(src, np.array([len(s) for s in src]), dictionary, tgt,
                               np.array([len(t) for t in tgt]), dictionary, shuffle=shuffle)


def joined(base, max_sentences=3, prob=0.5, seed=1, limits=(1024, 1024), epoch=1, from_epoch=1):
    dataset = ConcatenatedPairsDataset(base, max_sentences, prob, seed, *limits, from_epoch=from_epoch)
    dataset.set_epoch(epoch)
    return dataset


def plan(dataset):
    return [dataset.parts(i) for i in range(len(dataset))]


def test_the_joins_are_reproducible_per_seed_and_epoch_and_new_every_epoch():
    base = pairs_dataset()
    first = plan(joined(base, seed=1, epoch=1))
    assert plan(joined(base, seed=1, epoch=1)) == first  # another run, the same seed
    assert plan(joined(base, seed=1, epoch=2)) != first  # new combinations every epoch
    assert plan(joined(base, seed=2, epoch=1)) != first  # another seed
    dataset = joined(base, seed=1, epoch=1)
    dataset.set_epoch(2)
    second = plan(dataset)
    dataset.set_epoch(1)  # a resume in epoch 1 sees epoch 1's joins again
    assert plan(dataset) == first and second == plan(joined(base, seed=1, epoch=2))


def test_a_share_prob_of_the_pairs_is_joined_with_1_to_k_minus_1_others():
    base = pairs_dataset(pairs=2000)
    parts = plan(joined(base, max_sentences=4, prob=0.3))
    assert [p[0] for p in parts] == list(range(len(base)))  # example i leads with pair i
    with_others = [p for p in parts if len(p) > 1]
    assert 0.25 < len(with_others) / len(parts) < 0.35
    assert {len(p) for p in with_others} == {2, 3, 4}
    assert all(p[0] not in p[1:] for p in with_others)  # never joined with itself
    assert plan(joined(base, prob=0.0)) == [[i] for i in range(len(base))]
    assert plan(joined(base, max_sentences=1, prob=1.0)) == [[i] for i in range(len(base))]


def test_before_concat_from_epoch_the_pairs_train_alone_and_then_join_as_from_the_start():
    base = pairs_dataset()
    alone = [[i] for i in range(len(base))]
    assert plan(joined(base, epoch=1, from_epoch=3)) == alone
    assert plan(joined(base, epoch=2, from_epoch=3)) == alone
    assert (joined(base, epoch=2, from_epoch=3).sizes == np.stack([base.src_sizes, base.tgt_sizes], axis=1)).all()
    for epoch in (3, 4):  # an epoch's joins are those it has when joining from the start
        assert plan(joined(base, epoch=epoch, from_epoch=3)) == plan(joined(base, epoch=epoch)) != alone


def test_sources_join_sources_and_targets_join_targets_dropping_the_inner_eos():
    base = pairs_dataset()
    dataset = joined(base, prob=1.0)
    eos = base.src_dict.eos()
    for index in range(len(dataset)):
        parts = dataset.parts(index)
        item = dataset[index]
        for side in ("source", "target"):
            expected = torch.cat([base[j][side][:-1] for j in parts] + [torch.tensor([eos])])
            assert torch.equal(item[side], expected)
        assert item["id"] == index
        assert dataset.size(index) == (len(item["source"]), len(item["target"]))
        assert dataset.num_tokens(index) == max(len(item["source"]), len(item["target"]))
    assert (dataset.sizes[:, 0] > base.src_sizes).any()


@pytest.mark.parametrize("limits", [(12, 30), (30, 12), (14, 14)])
def test_joins_stay_within_the_maximum_positions(limits):
    base = pairs_dataset(pairs=500)
    dataset = joined(base, max_sentences=5, prob=1.0, limits=limits)
    lengths = np.array([[len(dataset[i]["source"]), len(dataset[i]["target"])] for i in range(len(dataset))])
    longer = lengths > np.stack([base.src_sizes, base.tgt_sizes], axis=1)
    assert longer.any()  # there were joins, ...
    assert (lengths[longer.any(axis=1)] <= np.array(limits)).all()  # ... all within the limits
    # the limits fairseq resolves for the batches (--max-tokens, the model's) are kept too
    dataset.limit_lengths((1024, 10))
    assert all(len(dataset[i]["target"]) <= max(10, base.tgt_sizes[i]) for i in range(len(dataset)))
    assert dataset.filter_indices_by_size(np.arange(len(dataset)), (1024, 10))[1] == \
        [i for i in range(len(dataset)) if base.tgt_sizes[i] > 10]  # only the pairs too long alone


def test_the_batches_follow_the_joined_sizes():
    dataset = joined(pairs_dataset(), prob=1.0)
    indices = dataset.ordered_indices()
    assert sorted(indices.tolist()) == list(range(len(dataset)))
    assert (np.diff(dataset.src_sizes[indices]) >= 0).all()
    batches = dataset.batch_by_size(indices, max_tokens=60)
    assert all(len(b) * max(dataset.num_tokens(i) for i in b) <= 60 for b in batches)
    batch = dataset.collater([dataset[i] for i in batches[-1]])
    assert batch["net_input"]["src_tokens"].size(1) == max(dataset.src_sizes[i] for i in batches[-1])
    assert not dataset.can_reuse_epoch_itr_across_epochs  # the batches are made again every epoch


def test_bad_settings_are_refused_naming_the_flag():
    from fairseq_rope.tasks.translation_concat import TranslationConcatConfig, TranslationConcatTask

    for settings, flag in (({"concat_max_sentences": 0}, "--concat-max-sentences"),
                           ({"concat_prob": 1.5}, "--concat-prob"), ({"concat_from_epoch": 0}, "--concat-from-epoch")):
        with pytest.raises(OptionError, match=flag):
            TranslationConcatTask.setup_task(TranslationConcatConfig(**settings))


@pytest.mark.e2e
def test_stock_fairseq_train_trains_on_joined_pairs_and_records_their_length(tiny_data_bin, tmp_path):
    """The tiny corpus's pairs have at most 10 words (+ EOS): the recorded length of a training
    on joined pairs is longer; validation is fairseq's own set."""
    from fairseq import tasks
    from fairseq.data import LanguagePairDataset
    from omegaconf import OmegaConf

    data_bin = tiny_data_bin / "data-bin"
    proc = run_cli(["fairseq-train", data_bin, "--user-dir", "fairseq_rope", "--task", "translation_concat",
                    "--concat-max-sentences", "3", "--concat-prob", "1", "--arch", "transformer_rope_tiny",
                    "--cpu", "--optimizer", "adam", "--lr", "3e-3", "--max-tokens", "1500", "--seed", "1",
                    "--criterion", "label_smoothed_cross_entropy", "--max-update", "4", "--no-epoch-checkpoints",
                    "--save-dir", tmp_path, "--num-workers", "0", "--log-format", "simple"], timeout=300)
    log = proc.stdout + proc.stderr
    assert "training pairs joined with 1 to 2 others (--concat-prob 1, --concat-max-sentences 3)" in log
    state = torch.load(tmp_path / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    assert state["cfg"]["task"]["_name"] == "translation_concat"
    assert state["cfg"]["model"]["rope_trained_length"] > 11

    task = tasks.setup_task(OmegaConf.create({**state["cfg"]["task"], "data": str(data_bin)}))
    task.load_dataset("train")
    task.load_dataset("valid")
    assert isinstance(task.dataset("train"), ConcatenatedPairsDataset)
    assert type(task.dataset("valid")) is LanguagePairDataset and len(task.dataset("valid")) == 60
