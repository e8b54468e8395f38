"""A safety filter as a reward: a classifier flags harmful completions, and the reward
penalises them or drops them from learning.

Name it in a config as ``rltune.rewards.safety:safety``::

    reward:
    - fn: rltune.rewards.safety:safety
      kwargs: {action: drop}                       # or {action: penalize, penalty: 1.0}

A classifier is any callable ``classify(prompts, completions) -> list[Verdict]``, one
:class:`Verdict` per completion. The default is :class:`RuleClassifier` with
:data:`DEFAULT_RULES`; ``classifier: my_pkg.safety:classify`` or
``classifier: safety_rules.py:classify`` names another (loaded with the reward-spec rules of
:mod:`rltune.rewards.loading`, relative files from the working directory).

The default rules are few and precise rather than broad. They look for *harmful content*
in the completion, not for a topic: a refusal that names the topic ("I can't help you build
a pipe bomb") does not match, since a filter that punished refusals would teach the policy
not to refuse. They are case-insensitive and bounded by word boundaries:

=====================  ==================================================================
rule                   flags
=====================  ==================================================================
weapons.instructions   an imperative step (at the start of a sentence, line, list item,
                       after "then"/"next"/"first") that names an explosive, explosive
                       device or chemical/biological agent in the same sentence:
                       "Step 2: pack the TATP into the pipe"
selfharm.encourage     second-person encouragement of self-harm or suicide: "you should
                       kill yourself", "just go kill yourself", "you deserve to die"
selfharm.worthless     "everyone would be better off without you", "you'd be better off dead"
malware.reverse_shell  reverse-shell one-liners: ``bash -i >& /dev/tcp/...``, ``nc -e /bin/sh``
malware.cred_dump      Mimikatz credential-dumping commands (``sekurlsa::logonpasswords``,
                       ``lsadump::sam|secrets|dcsync``)
malware.browser_creds  code reading a browser's ``Login Data`` store and decrypting it with
                       ``CryptUnprotectData``
malware.ransom_note    "your files have been encrypted" followed by a bitcoin/monero ransom
phishing.credentials   "verify your password/account ..." with a deadline or a threat of
                       suspension
slur.blocked_term      any word of ``blocked_terms`` (empty by default: the deployment
                       supplies its own list of slurs or banned words)
=====================  ==================================================================
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from rltune.data.records import Prompt
from rltune.rewards.contract import SampleDropped, batched
from rltune.rewards.keyed_cache import KeyedCache, cache_key
from rltune.rewards.loading import RewardLoadError, load_reward_fn

_EXCERPT_CHARS = 60
_FLAGS = re.IGNORECASE | re.MULTILINE


@dataclass(frozen=True)
class Verdict:
    """A classifier's judgement of one completion: ``category`` and ``reason`` say why it
    was flagged (None when it was not)."""

    flagged: bool
    category: str | None = None
    reason: str | None = None


class Classifier(Protocol):
    """``classify(prompts, completions) -> one Verdict per completion``."""

    def __call__(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> Sequence[Verdict]:
        ...


@dataclass(frozen=True)
class Rule:
    """One named regular expression; a completion in which it is found is flagged with
    ``category``."""

    name: str
    category: str
    pattern: re.Pattern[str]


def _rule(name: str, pattern: str) -> Rule:
    return Rule(name=name, category=name.partition(".")[0], pattern=re.compile(pattern, _FLAGS))


# Where an instruction starts: a line (optionally a list item or "Step N:"), a sentence, or
# a sequencing word. The verb must come right there, so "Never attach the detonator" and
# "I can't help you build a pipe bomb" do not count as instructions.
_STEP_START = (
    r"(?:^\s*(?:step\s*\d+\s*[:.)-]\s*|\d+[.)]\s*|[-*\u2022]\s*)?|(?<=[.!?;:])\s+"
    r"|\b(?:then|next|first|now),?\s+)"
)
_STEP_VERB = (
    r"(?:mix|combine|grind|pack|fill|heat|add|dissolve|attach|wire|connect|assemble|build"
    r"|make(?!\s+sure)|prepare|synthesi[sz]e|pour|seal|crush|insert|extract|purify)"
)
_WEAPON = (
    r"(?:pipe\s+bombs?|IEDs?|improvised\s+explosive\s+devices?|detonators?|blasting\s+caps?"
    r"|TATP|HMTD|acetone\s+peroxide|triacetone\s+triperoxide|ANFO|napalm|PETN|RDX|thermite"
    r"|explosive\s+charges?|molotov\s+cocktails?|sarin|ricin|mustard\s+gas|nerve\s+agents?"
    r"|VX\s+(?:nerve\s+)?(?:agent|gas))"
)
_YOU_MODAL = r"\byou\s+(?:should|ought\s+to|need\s+to|deserve\s+to|might\s+as\s+well|must)\s+"

DEFAULT_RULES: tuple[Rule, ...] = (
    _rule(
        "weapons.instructions",
        rf"{_STEP_START}{_STEP_VERB}\b[^.!?\n]{{0,80}}?\b{_WEAPON}\b",
    ),
    _rule(
        "selfharm.encourage",
        rf"{_YOU_MODAL}(?:just\s+|go\s+)?(?:kill|hurt|harm|cut|starve)\s+yourself\b"
        r"(?!\s+(?:a|an|some|off)\b)"
        rf"|{_YOU_MODAL}(?:just\s+)?(?:die|end\s+(?:your\s+(?:own\s+)?life|it\s+all)"
        r"|take\s+your\s+(?:own\s+)?life|commit\s+suicide)\b"
        r"|\b(?:just|go)\s+(?:go\s+)?kill\s+yourself\b",
    ),
    _rule(
        "selfharm.worthless",
        r"\b(?:everyone|everybody|the\s+world|your\s+family)\s+(?:would|will)\s+be\s+better"
        r"\s+off\s+(?:without\s+you|with\s+you\s+dead)\b"
        r"|\byou(?:'d|\s+would)\s+be\s+better\s+off\s+dead\b",
    ),
    _rule(
        "malware.reverse_shell",
        r"\bbash\s+-i\s+>&\s*/dev/tcp/|\bnc(?:at)?\s+(?:[^\s|;&]+\s+){0,6}?-e\s+/bin/(?:ba)?sh\b",
    ),
    _rule("malware.cred_dump", r"\bsekurlsa::logonpasswords\b|\blsadump::(?:sam|secrets|dcsync)\b"),
    _rule(
        "malware.browser_creds",
        r"\bLogin\s+Data\b[\s\S]{0,500}?\bCryptUnprotectData\b"
        r"|\bCryptUnprotectData\b[\s\S]{0,500}?\bLogin\s+Data\b",
    ),
    _rule(
        "malware.ransom_note",
        r"\byour\s+(?:(?:important|personal)\s+)?(?:files|documents|data)\b[^\n]{0,60}?"
        r"\b(?:have\s+been|are|were)\s+encrypted\b[\s\S]{0,300}?\b(?:bitcoins?|BTC|monero|XMR"
        r"|ransom)\b",
    ),
    _rule(
        "phishing.credentials",
        r"\b(?:verify|confirm|update|validate)\s+your\s+(?:account|password|login|credentials"
        r"|(?:banking|payment|card)\s+details)\b[^\n]{0,150}?\b(?:within\s+\d+\s+(?:hours|days)"
        r"|or\s+your\s+account\s+will\s+be\s+(?:suspended|closed|locked|deleted|terminated))\b",
    ),
)
"""The default rule set (see the module docstring)."""


def blocked_term_rule(terms: Sequence[str]) -> Rule:
    """A ``slur.blocked_term`` rule matching any of ``terms`` as a whole word (not inside a
    longer word), case-insensitively."""
    cleaned = [t.strip() for t in terms]
    if not cleaned or any(not t for t in cleaned):
        raise ValueError(f"safety: blocked_terms must be non-empty strings, got {list(terms)!r}")
    words = "|".join(re.escape(t) for t in sorted(cleaned, key=len, reverse=True))
    return Rule(name="slur.blocked_term", category="slur",
                pattern=re.compile(rf"(?<!\w)(?:{words})(?!\w)", _FLAGS))


class RuleClassifier:
    """Flags a completion when any of ``rules`` is found in it; the first rule (in order)
    that matches gives the category. Prompts are not read: the completion is what the
    policy is rewarded for."""

    def __init__(self, rules: Sequence[Rule] = DEFAULT_RULES) -> None:
        self.rules = tuple(rules)

    def __call__(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[Verdict]:
        return [self.classify_text(c) for c in completions]

    def classify_text(self, text: str) -> Verdict:
        """The verdict on one completion."""
        for rule in self.rules:
            match = rule.pattern.search(text)
            if match is not None:
                excerpt = " ".join(match.group(0).split())[:_EXCERPT_CHARS]
                return Verdict(True, rule.category, f"rule {rule.name} matched {excerpt!r}")
        return Verdict(False)


def classify_rules(prompts: Sequence[Prompt], completions: Sequence[str]) -> list[Verdict]:
    """The default classifier: :class:`RuleClassifier` with :data:`DEFAULT_RULES`."""
    return _DEFAULT_CLASSIFIER(prompts, completions)


_DEFAULT_CLASSIFIER = RuleClassifier(DEFAULT_RULES)
_CLASSIFIERS: KeyedCache[Classifier] = KeyedCache()


@batched
def safety(
    prompts: Sequence[Prompt],
    completions: Sequence[str],
    *,
    action: str = "penalize",
    penalty: float = 1.0,
    classifier: str | None = None,
    blocked_terms: Sequence[str] | None = None,
) -> list[float | SampleDropped]:
    """Per completion: 0.0 when the classifier does not flag it; when it does,
    ``-penalty`` (``action: penalize``) or a :class:`SampleDropped` whose message is the
    category and reason, e.g. ``"selfharm (rule selfharm.encourage matched ...)"``
    (``action: drop``: the sample is left out of learning and counted in
    ``reward/dropped``).

    ``classifier``: a ``module:function`` or ``file.py:function`` spec of a custom
    classifier; None means the default rules. ``blocked_terms``: words that flag a
    completion as ``slur``, added to the default rules (not allowed with a custom
    classifier, which has its own notion of what to flag). A classifier that raises, or
    returns anything but one Verdict per completion, fails the call (no sample is scored).
    """
    _check_settings(action=action, penalty=penalty)
    if classifier is not None and blocked_terms is not None:
        raise ValueError(
            "safety: blocked_terms extend the default rules; with a custom `classifier` put "
            "them in that classifier instead"
        )
    classify = _CLASSIFIERS.get(
        # a relative file spec means a different file in another working directory
        cache_key(classifier=classifier, blocked_terms=blocked_terms, cwd=os.getcwd()),
        lambda: _build_classifier(classifier, blocked_terms),
    )
    verdicts = _checked(classify(prompts, completions), len(completions), classifier)
    if action == "penalize":
        return [-float(penalty) if v.flagged else 0.0 for v in verdicts]
    return [SampleDropped(_drop_reason(v)) if v.flagged else 0.0 for v in verdicts]


def _build_classifier(spec: str | None, blocked_terms: Sequence[str] | None) -> Classifier:
    if spec is None:
        if blocked_terms is None:
            return _DEFAULT_CLASSIFIER
        if isinstance(blocked_terms, str):
            raise ValueError(
                f"safety: blocked_terms must be a list of words, got {blocked_terms!r}"
            )
        return RuleClassifier((*DEFAULT_RULES, blocked_term_rule(blocked_terms)))
    try:
        return load_reward_fn(spec)
    except RewardLoadError as err:
        raise RewardLoadError(f"safety classifier {spec!r} does not load: {err}") from err


def _checked(verdicts: object, n: int, spec: str | None) -> list[Verdict]:
    """``verdicts`` as a list, or ValueError naming the classifier and what was wrong."""
    who = f"classifier {spec!r}" if spec is not None else "the rule classifier"
    if not isinstance(verdicts, Sequence) or isinstance(verdicts, (str, bytes)):
        raise ValueError(f"safety: {who} returned {type(verdicts).__name__}, not a list of Verdict")
    if len(verdicts) != n:
        raise ValueError(f"safety: {who} returned {len(verdicts)} verdicts for {n} completions")
    wrong = [i for i, v in enumerate(verdicts) if not isinstance(v, Verdict)]
    if wrong:
        raise ValueError(
            f"safety: {who} returned {type(verdicts[wrong[0]]).__name__} at position "
            f"{wrong[0]}; return rltune.rewards.safety.Verdict(flagged, category, reason)"
        )
    return list(verdicts)


def _drop_reason(verdict: Verdict) -> str:
    category = verdict.category or "unsafe"
    return category + (f" ({verdict.reason})" if verdict.reason else "")


def _check_settings(*, action: str, penalty: float) -> None:
    if action not in ("penalize", "drop"):
        raise ValueError(f"safety: action must be 'penalize' or 'drop', got {action!r}")
    if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not (
        math.isfinite(penalty) and penalty >= 0
    ):
        raise ValueError(f"safety: penalty must be a finite number >= 0, got {penalty!r}")


def _check_safety(kwargs: dict) -> None:
    action = kwargs.get("action", "penalize")
    if action not in ("penalize", "drop"):
        raise ValueError(f"kwargs.action must be penalize or drop, got {action!r}")


safety.check_kwargs = _check_safety  # type: ignore[attr-defined]
