"""bench-turn's replay: a run's pauses decided again under other thresholds, as the listener would have."""

from commands.bench_turn import decide_again, ends_at, summarize
from pipeline.turn_end import TurnEnd


def pause(words, audio, target, words_at=150.0, audio_at=40.0, target_at=320.0, silence_ms=None):
    return {
        "words": words,
        "end_of_turn_probability": audio,
        "end_of_message_probability": target,
        "words_at_ms": words_at,
        "end_of_turn_probability_at_ms": audio_at,
        "end_of_message_probability_at_ms": target_at,
        "silence_ms": silence_ms,
    }


def test_a_finished_pause_ends_when_the_last_vote_is_in_on_a_frame():
    turn_end = TurnEnd(complete_ms=200, unsure_ms=700, incomplete_ms=1000)
    assert ends_at(turn_end, pause("Is it raining?", 0.9, 0.8)) == 320  # the target's vote, at 320 ms
    assert ends_at(turn_end, pause("Is it raining?", 0.9, 0.8, target_at=100, words_at=90)) == 224  # 200, on a frame
    assert ends_at(turn_end, pause("Is it raining?", 0.9, 0.05)) == 1024  # the target reads it as going on
    lone = {"words": "Is it", "words_at_ms": 150.0, "silence_ms": None}  # no other signal ever came
    assert ends_at(turn_end, lone) == 1024 and ends_at(TurnEnd(complete_ms=2000, incomplete_ms=3000), {}) == 3008


def test_a_turn_is_cut_when_a_pause_before_its_last_would_have_ended_it():
    mid = pause("Tell me a joke.", 0.95, 0.6, silence_ms=500)  # both finished by 320 ms, the speaker back at 500
    last = pause("Tell me a joke about cats.", 0.95, 0.7)
    turn = {"name": "cats", "pause_ms": 500, "pauses": [mid, last]}
    finished = {"name": "rain", "pause_ms": 0, "pauses": [pause("Is it raining?", 0.9, 0.8)]}
    strict = TurnEnd(words_threshold=0.65)  # the mid pause's 0.6 now reads as going on
    assert decide_again(TurnEnd(), [turn, finished]) == {
        "paused_turns_whole": 0,
        "paused_turns": 1,
        "finished_wait_ms_median": 320,
        "cut": ["cats"],
    }
    assert decide_again(strict, [turn, finished])["paused_turns_whole"] == 1
    # A run that cut a turn saw none of its later pauses: cut whatever the thresholds.
    assert decide_again(strict, [{"name": "x", "pause_ms": 500, "pauses": [mid]}])["cut"] == ["x"]


def test_a_pause_held_open_for_its_answer_cuts_only_once_that_answer_could_be_heard():
    last = pause("Tell me a joke about cats.", 0.95, 0.7)

    def cut(**held) -> bool:
        mid = {**pause("Tell me a joke.", 0.95, 0.6, silence_ms=500), **held}  # its wait runs out at 320 ms
        return decide_again(TurnEnd(), [{"name": "cats", "pause_ms": 500, "pauses": [mid, last]}])["cut"] == ["cats"]

    assert cut()  # no early answer held on the words: ended at 320 ms
    assert not cut(answer_held=True, answer_playable_at_ms=650)  # audible after the speaker was back
    assert not cut(answer_held=True)  # never audible: held to the longest wait (1000 ms)
    assert cut(answer_held=True, answer_playable_at_ms=450)  # audible at 450 ms, before the speaker came back
    assert cut(answer_held=False, answer_playable_at_ms=650)


def test_the_summary_reports_the_slowest_words_and_turn_beside_the_medians():
    """One slow ASR pass leaves a pause without words and its turn waits the long wait: a median hides it."""
    slow = {**pause("Tell me a story.", 0.9, 0.03, words_at=700.0), "asr_pass_ms": 650.0}
    turns = [
        {
            "name": "story",
            "pause_ms": 0,
            "whole": True,
            "heard_right": True,
            "ttfa_ms": 1790.0,
            "end_of_turn_wait_ms": 1024.0,
            "pauses": [slow],
        },
    ] + [
        {
            "name": f"q{i}",
            "pause_ms": 0,
            "whole": True,
            "heard_right": True,
            "ttfa_ms": 400.0 + i,
            "end_of_turn_wait_ms": 300.0,
            "pauses": [{**pause("Why?", 0.9, 0.8), "asr_pass_ms": 150.0}],
        }
        for i in range(4)
    ]
    summary = summarize(turns)
    assert summary["words_at_ms_median"] == 150 and summary["words_at_ms_max"] == 700
    assert summary["asr_pass_ms_median"] == 150 and summary["asr_pass_ms_max"] == 650
    assert summary["ttfa_ms_max"] == 1790
