"""Where a model's gradient table lives is the model's own choice (no process-wide switch), and
DataParallel's transports share one interface. The transports' sums over several ranks are
tested in tests/test_distributed_training.py (shared memory and the group, 2 and 3 ranks)."""
import inspect

import numpy as np
import pytest

import fasttran
from fasttran import _C
from fasttran.distributed import DataParallel, Group, GroupAllReduce, OneProcess, SharedMemorySum
from fasttran.finetune import TopLayers
from fasttran.heads import ClassificationHead
from fasttran.model import Model


def _shared(tensor):
    """the shared allocation holding a flat table, or None"""
    return _C.shared_memory_of(tensor.data_ptr)


def _head(hidden=8):
    return ClassificationHead(hidden, num_labels=3, seed=0)


def test_a_model_asks_for_shared_gradients_and_only_it_gets_them():
    shared = Model(_head(), None, "cpu", shared_grads=True)
    after = Model(_head(), None, "cpu")   # made after a shared one: plain memory (nothing process-wide)
    plain = Model(_head(), None, "cpu", shared_grads=False)
    fd, offset, nbytes = _shared(shared.grads)
    assert offset == 0 and nbytes >= shared.grads.nbytes
    assert _shared(after.grads) is None and _shared(plain.grads) is None
    assert _shared(shared.params) is None             # only the gradients
    # the table works as before: zeros, written by a step like any other
    assert not np.asarray(shared.grads).any()


def test_top_layers_take_the_choice_and_the_model_uses_their_table(checkpoint):
    enc = fasttran.Encoder.from_pretrained(checkpoint(hidden_size=16, num_attention_heads=2, intermediate_size=32,
                                                      num_hidden_layers=2, vocab_size=50, max_position_embeddings=32))
    head = _head(16)
    top = TopLayers(enc, 1, extra=head.num_parameters, shared_grads=True)
    model = Model(head, top, "cpu")                   # the stack's table is the model's
    assert _shared(top.grads) is not None and model.grads.data_ptr == top.grads.data_ptr
    other = TopLayers(enc, 1, extra=head.num_parameters)
    assert _shared(other.grads) is None


def test_the_veto_keeps_tables_out_of_shared_memory_and_says_what_it_was():
    was = _C.shared_grads(False)
    try:
        assert was is True
        vetoed = Model(_head(), None, "cpu", shared_grads=True)
        assert _shared(vetoed.grads) is None
        assert _C.shared_grads(True) is False
        assert _shared(Model(_head(), None, "cpu", shared_grads=True).grads) is not None
    finally:
        _C.shared_grads(was)


def test_one_process_data_parallel_is_the_identity():
    dp = DataParallel(group=Group())
    assert dp.shared_grads is False                   # one rank: nothing to share with
    model = Model(_head(), None, "cpu", shared_grads=dp.shared_grads)
    with pytest.raises(fasttran.InputError, match="start"):
        dp.begin(0)
    dp.start(model, {"examples": 3})
    assert dp.transport_used == "one process" and repr(dp).endswith(", one process, one process)")
    dp.begin(0)
    dp.ready(0)
    assert dp.finish(np.float32(1.25)) == 1.25 and dp.seconds["steps"] == 1


def test_the_transports_share_one_interface():
    """the three classes DataParallel forwards to have the same methods, with the same arguments"""
    methods = {"begin": ["self", "step"], "ready": ["self", "bucket"], "finish": ["self", "loss"]}
    for cls in (OneProcess, GroupAllReduce, SharedMemorySum):
        for name, params in methods.items():
            assert list(inspect.signature(getattr(cls, name)).parameters) == params, (cls, name)
    assert SharedMemorySum.name == "shared_memory" and OneProcess(Group()).name == "one process"


def test_groups_answer_what_the_shared_memory_transport_asks():
    g = Group()
    assert g.one_machine is True and g.whereabouts() == []
    assert g.check_peers("a wait", {}, 0.0) is None
