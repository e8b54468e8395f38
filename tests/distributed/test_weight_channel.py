"""The broadcast weight channel on its own (gloo, two members in threads of this
process): a receiver whose weights are laid out as the sender's takes them in place, and
one that is not (a vLLM engine) takes them bucket by bucket as views it can load."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from rltune.runtime.ray import sync


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w.a": torch.randn(3, 4, generator=g),
        "w.b": torch.randn(5, generator=g),
        "w.c": torch.randn(2, 2, generator=g).double(),
        "w.d": torch.randn(6, 2, generator=g),
    }


def pair(receive):
    """Run the sender (rank 0, version 7) and ``receive(channel)`` (rank 1) together."""
    port, sent, out, errors = free_port(), weights(), {}, []

    def sender() -> None:
        try:
            channel = sync.WeightChannel("127.0.0.1", port, 0, 2, device=torch.device("cpu"), timeout_s=30)
            out["bytes"] = channel.send(sent, 7)
            channel.close()
        except Exception as err:  # noqa: BLE001 - reported by the test below
            errors.append(err)

    thread = threading.Thread(target=sender)
    thread.start()
    channel = sync.WeightChannel("127.0.0.1", port, 1, 2, device=torch.device("cpu"), timeout_s=30)
    out["received"] = receive(channel)
    channel.close()
    thread.join(30)
    assert not errors, errors
    return sent, out


def test_a_receiver_of_the_same_layout_takes_the_weights_in_place() -> None:
    held = {k: torch.zeros_like(v) for k, v in weights().items()}
    sent, out = pair(lambda channel: channel.receive_into(held))
    assert out["received"] == 7
    for name, tensor in sent.items():
        assert torch.equal(held[name], tensor), name
    assert out["bytes"] == sum(t.numel() * t.element_size() for t in sent.values())


def test_a_receiver_of_another_layout_takes_them_a_bucket_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sync, "BUCKET_BYTES", 64)  # w.a (48 B) | w.b (20 B) | w.c (float64) | w.d (48 B)
    layout = sync.layout(weights())

    def receive(channel):
        version, buckets = channel.receive_buckets(layout)
        got = []
        for bucket in buckets:
            got.append([(name, tensor.clone()) for name, tensor in bucket])
        return version, got

    sent, out = pair(receive)
    version, got = out["received"]
    assert version == 7
    assert [[name for name, _ in bucket] for bucket in got] == [["w.a"], ["w.b"], ["w.c"], ["w.d"]]
    for name, tensor in (item for bucket in got for item in bucket):
        assert tensor.dtype == sent[name].dtype and torch.equal(tensor, sent[name]), name
