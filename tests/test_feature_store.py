"""FeatureStore.write picks the drafter's columns straight from the hidden state or the aux taps where they
lie in one part, and from their concatenation where they cross: every case equals indexing the full table."""

import numpy as np
import pytest
import torch
from specwire.verifier.feature_store import FeatureStore, feature_table

H, AUX = 4, 12  # hidden size, three aux taps of it

COLUMNS = {
    "aux taps (an EAGLE-3 head)": slice(H, H + AUX),
    "hidden only (an EAGLE-1 head)": slice(0, H),
    "a slice across both": slice(2, 10),
    "a slice inside the aux taps": slice(H + 4, H + 8),
    "scattered aux columns": np.array([5, 9, 15, 6]),
    "scattered hidden columns": np.array([3, 0]),
    "scattered across both": np.array([1, 6, 3, 12]),
}


@pytest.mark.parametrize("columns", COLUMNS.values(), ids=COLUMNS.keys())
@pytest.mark.parametrize("with_aux", [True, False], ids=["aux", "no aux"])
def test_written_rows_are_the_tables_picked_columns(columns, with_aux):
    if not with_aux and (columns.stop if isinstance(columns, slice) else columns.max() + 1) > H:
        pytest.skip("columns past the hidden state need aux taps")
    generator = torch.Generator().manual_seed(0)
    fed = 7  # rows the forward ran on; fewer than the buffers' rows, as in a padded graph replay
    first_hidden = torch.randn(fed + 3, H, generator=generator)
    first_aux = torch.randn(fed + 3, AUX, generator=generator) if with_aux else None
    width = len(range(H + AUX)[columns]) if isinstance(columns, slice) else len(columns)
    store = FeatureStore(slots=3, max_context=5, columns=columns, width=width, dtype=torch.float32,
                         device=torch.device("cpu"))
    store.rows.fill_(float("nan"))
    slots, positions = [0, 0, 0, 2, 2, 1, 1], [0, 1, 2, 3, 4, 0, 4]
    # Two writes, as two rounds: the second picks the same columns of its own inputs (the store keeps its
    # column index on the device between writes).
    again = (first_hidden.flip(0), None if first_aux is None else first_aux.flip(0))
    rounds = [(first_hidden, first_aux), again]
    for hidden, aux in rounds:
        store.write(hidden, aux, slots, positions)
        table = feature_table(hidden, aux)[:fed]
        expected = table[:, columns] if isinstance(columns, slice) else table[:, torch.as_tensor(columns)]
        torch.testing.assert_close(store.rows[slots, positions], expected, rtol=0, atol=0)
    written = torch.zeros(3, 5, dtype=torch.bool)
    written[slots, positions] = True
    assert store.rows[~written].isnan().all(), "a row nobody wrote was touched"
