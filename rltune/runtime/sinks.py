"""Where a run's metrics go: ``metrics.jsonl`` always, and the sinks ``log`` turns on
(TensorBoard, Weights & Biases, MLflow). One step's typed metrics are split here into
scalars and histograms and handed to every sink.

``metrics.jsonl`` is the record the run is judged and resumed by: a failure to write it
stops the run. An optional sink that fails while the run trains (a full disk under its
own directory, a tracking server gone away) is reported once and closed, and training
goes on; one that cannot be opened at the start is an error, before any step runs.

``samples.jsonl`` is written through :class:`SampleLog`, which also stores the images of
a vision-language run's prompts, once each, under ``images/`` (:mod:`rltune.metrics.images`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rltune.config.schema import Config
from rltune.data.records import Prompt, PromptImage
from rltune.metrics.images import ImageStore
from rltune.metrics.sinks import JsonlWriter
from rltune.metrics.types import MetricLike, histograms, scalars


class SinkError(RuntimeError):
    """An optional metric sink could not be opened (its package is missing, or its
    settings are wrong)."""


class MetricSinks:
    """``metrics.jsonl`` plus the optional sinks, as one."""

    def __init__(self, jsonl: JsonlWriter, others: list[tuple[str, Any]] | None = None) -> None:
        self.jsonl = jsonl
        self.others = list(others or [])
        self.failed: dict[str, str] = {}

    def __enter__(self) -> "MetricSinks":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log(self, step: int, metrics: Mapping[str, MetricLike]) -> dict[str, float]:
        """Write one step's metrics; returns its scalars (what ``metrics.jsonl`` holds)."""
        values = scalars(metrics)
        self.jsonl.write({"step": step, **values})
        hists = histograms(metrics)
        for name, sink in list(self.others):
            self._guard(name, sink, lambda s: s.log(step, values, hists))
        return values

    def log_config(self, config: Mapping[str, Any]) -> None:
        for name, sink in list(self.others):
            self._guard(name, sink, lambda s: s.log_config(config))

    def close(self) -> None:
        self.jsonl.close()
        for name, sink in self.others:
            self._guard(name, sink, lambda s: s.close(), closing=True)
        self.others = []

    def _guard(self, name: str, sink: Any, call: Any, *, closing: bool = False) -> None:
        try:
            call(sink)
        except Exception as err:  # noqa: BLE001 - a sink must not end the run
            self.failed[name] = f"{type(err).__name__}: {err}"
            print(f"warning: the {name} metric sink failed ({self.failed[name]}); "
                  "it is closed, metrics.jsonl goes on", file=sys.stderr)
            if not closing:
                self.others = [(n, s) for n, s in self.others if s is not sink]
                try:
                    sink.close()
                except Exception:  # noqa: BLE001 - already reported
                    pass


_IMAGE_PARTS = ("image", "image_url")
"""The ``type`` of a message part that holds an image (HF's and OpenAI's chat formats)."""


class SampleLog:
    """``samples.jsonl`` (truncated to ``resume_after_step`` when resuming) and the run's
    ``images/`` folder, which a resumed run keeps: images already there are not written
    again."""

    def __init__(self, run_dir: Path, *, resume_after_step: int | None) -> None:
        self.jsonl = JsonlWriter(run_dir / "samples.jsonl", resume_after_step=resume_after_step)
        self.images = ImageStore(run_dir)

    def image_refs(self, images: list[PromptImage]) -> list[dict[str, str]]:
        """``{"path", "source"}`` for each image, in order; ``path`` (``images/<digest>.<ext>``,
        relative to the run directory) is written the first time an image is referred to."""
        return [{"path": self.images.add(image.digest, image.data), "source": image.source} for image in images]

    def write(self, record: dict[str, Any]) -> None:
        self.jsonl.write(record)

    @staticmethod
    def prompt_record(prompt: Prompt) -> str | list[dict[str, Any]]:
        """The prompt as ``samples.jsonl`` holds it: the text, or the messages with each
        image part (``image``, ``image_url``) written as ``{"type": "image"}`` (the record's
        ``images`` name them, in order; an image's bytes or data URI is not copied into
        every sample)."""
        if prompt.text is not None:
            return prompt.text
        assert prompt.messages is not None
        return [
            {**message, "content": [
                {"type": "image"} if isinstance(part, dict) and part.get("type") in _IMAGE_PARTS else part
                for part in message["content"]
            ]} if isinstance(message.get("content"), list) else message
            for message in prompt.messages
        ]

    def close(self) -> None:
        self.jsonl.close()


def open_sinks(cfg: Config, run_dir: Path, *, resume_after_step: int | None) -> MetricSinks:
    """``metrics.jsonl`` (truncated to ``resume_after_step`` when resuming) and every sink
    ``cfg.log`` turns on, with the resolved config logged to each."""
    jsonl = JsonlWriter(run_dir / "metrics.jsonl", resume_after_step=resume_after_step)
    others: list[tuple[str, Any]] = []
    try:
        for name, opener in _OPENERS:
            sink = opener(cfg, run_dir, resume_after_step)
            if sink is not None:
                others.append((name, sink))
    except BaseException:
        jsonl.close()
        for _, sink in others:
            sink.close()
        raise
    sinks = MetricSinks(jsonl, others)
    sinks.log_config(cfg.model_dump(mode="json"))
    return sinks


def _tensorboard(cfg: Config, run_dir: Path, resume: int | None) -> Any:
    if not cfg.log.tensorboard:
        return None
    from rltune.metrics.sinks import TensorBoardSink

    return _opened("tensorboard", lambda: TensorBoardSink(run_dir / "tensorboard", resume_after_step=resume))


def _wandb(cfg: Config, run_dir: Path, resume: int | None) -> Any:
    w = cfg.log.wandb
    if w is None:
        return None

    def make() -> Any:
        from rltune.metrics.wandb import WandbSink

        return WandbSink(run_dir, project=w.project, mode=w.mode, entity=w.entity,
                         name=w.name or cfg.name, tags=w.tags, resume_after_step=resume)

    return _opened("wandb", make)


def _mlflow(cfg: Config, run_dir: Path, resume: int | None) -> Any:
    m = cfg.log.mlflow
    if m is None:
        return None

    def make() -> Any:
        from rltune.metrics.mlflow import MlflowSink

        return MlflowSink(run_dir, tracking_uri=m.tracking_uri, experiment=m.experiment,
                          run_name=m.run_name or cfg.name, resume_after_step=resume)

    return _opened("mlflow", make)


def _opened(name: str, make: Any) -> Any:
    try:
        return make()
    except ImportError as err:
        raise SinkError(f"log.{name} is on but {err}") from None
    except Exception as err:  # noqa: BLE001 - named and re-raised as a user-facing error
        raise SinkError(f"log.{name}: could not start the {name} sink: {type(err).__name__}: {err}") from err


_OPENERS = (("tensorboard", _tensorboard), ("wandb", _wandb), ("mlflow", _mlflow))
