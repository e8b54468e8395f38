"""Pipeline parallelism runs token ids only: a batch with images is refused with the fix,
not trained without its pictures."""

from __future__ import annotations

import pytest
import torch

from rltune.data.records import TrainBatch
from rltune.parallel.pipeline import equalise


def _batch(vision) -> TrainBatch:
    ids = torch.tensor([[1, 2, 3, 4]])
    return TrainBatch(input_ids=ids, attention_mask=torch.ones_like(ids), prompt_len=2,
                      loss_mask=torch.ones(1, 2), vision=vision)


def test_a_batch_with_images_is_refused() -> None:
    assert equalise([_batch(None)], 1).input_ids.shape == (1, 4)
    with pytest.raises(ValueError, match="has images: train a vision-language model with pp: 1"):
        equalise([_batch(None), _batch([{"pixel_values": torch.zeros(4, 6)}])], 2)
