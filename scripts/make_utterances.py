"""Write spoken questions for `say` and `bench-voice`, with their transcripts (transcripts.json).

- questions (assets/utterances): spoken by the Piper "joe" voice (a natural voice, so faster-whisper tiny.en hears
  the words; espeak-ng's robot voice was misheard in 5 of 8 questions). The tests replay these.
- heldout (assets/utterances-heldout): other questions in hibari's "heart" voice, which no test uses: the
  benchmarks' held-out set.
- pauses (assets/utterances-pauses): hibari "heart", each question cut after an unfinished phrase by exactly
  PAUSE_S of silence ("What is the capital of … Canada?"): a turn must not end at the pause.
- turns-tune (assets/utterances-turns-tune) and turns-final (assets/utterances-turns-final): when does a turn end?
  Two sets in other words, one to tune the turn-end thresholds on and one kept apart for the final figures. Each has
  36 turns with a mid-sentence pause (TURN_PAUSES_MS, 300-800 ms) after an unfinished phrase of six kinds
  (TURN_KINDS: a preposition, an article, a conjunction, a verb wanting its object, a clause that sounds finished
  but goes on, a filler) and 18 finished questions, in six voices (hibari "heart" at several speeds, Piper "joe",
  espeak-ng voices, which Whisper tiny.en often mishears, as a new user's may be): voice, pause length and kind are
  crossed, each voice with each pause length once and each kind once per voice and per length. The final set adds
  voices and speeds the tune set lacks. turns.json says, per recording, its text, voice, pause_ms (0: finished) and
  pause_after (the phrase before the pause, or null). A rerun remakes them a little differently: espeak-ng speaks
  the same samples each time, hibari the same lengths (samples within 0.01), Piper at random (lengths too).
- turns-tune-flow and turns-final-flow (assets/utterances-turns-tune-flow, assets/utterances-turns-final-flow): the
  36 paused turns of turns-tune and turns-final (same names, texts, voices, pause lengths; the finished questions are
  in those sets), spoken "flow" style. The sets above speak the phrase before the pause and the rest as two
  sentences, so the phrase ends on a finished sentence's falling pitch, and an audio end-of-turn model rightly hears
  it as finished; a person who stops mid-sentence keeps the sentence's intonation going. Here the whole sentence is
  one synthesis and the silence goes in at the word boundary after the phrase: espeak-ng through an SSML <break/>
  (it speaks on with a non-final tune: on "What is the difference between weather and", en-us 160 wpm, the last
  word holds at 92-97 Hz against 78-82 Hz spoken as a sentence of its own), hibari and Piper by cutting their
  sentence where faster-whisper's word timestamps put the boundary. The silence there is exactly pause_ms (the
  quiet samples the voice itself left at the boundary are replaced). turns.json adds "style": "flow".

Each file is resampled to 16 kHz mono 16-bit, transcribed back, and a mismatch is reported (for the turns sets it
does not fail the script: a summary line counts who was heard right, per voice).

    python3 scripts/make_utterances.py [--set questions|heldout|pauses|turns-tune|turns-final|turns-tune-flow|
        turns-final-flow] [--out DIR]
"""

from __future__ import annotations

import argparse
import difflib
import io
import json
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from xml.sax.saxutils import escape

import numpy as np
import soundfile as sf

from pipeline.asr import Transcriber
from pipeline.audio import SAMPLE_RATE, to_mono_16k
from pipeline.tts import TTS, HibariTTS, PiperTTS
from pipeline.wer import normalize_words, word_edits

QUESTIONS = {
    "capital": "What is the capital of France?",
    "minutes": "How many minutes are in a day?",
    "egg": "How do I boil an egg?",
    "seasons": "Why do we have seasons?",
    "python": "How do I reverse a list in Python?",
    "weekdays": "What are the seven days of the week?",
    "bread": "Why does bread go stale?",
    "sleep": "Give me a tip for sleeping better.",
    "weather": "Should I take an umbrella if it looks cloudy?",
    "tea": "How long should I steep green tea?",
    "plants": "How often should I water a cactus?",
    "moon": "Why does the moon change shape?",
}


HELDOUT = {
    "mountain": "What is the tallest mountain in the world?",
    "coffee": "How do I make a cup of coffee?",
    "sky": "Why is the sky blue?",
    "spider": "How many legs does a spider have?",
    "london": "What time zone is London in?",
    "book": "Can you recommend a good book?",
    "tie": "How do I tie a tie?",
    "boiling": "What is the boiling point of water?",
    "cats": "Why do cats purr?",
    "sun": "How far away is the sun?",
    "breakfast": "What should I eat for breakfast?",
    "hiccups": "How do I stop hiccups?",
}
PAUSE_S = 0.5
PAUSES = {  # the phrase before the pause, the rest
    "canada": ("What is the capital of", "Canada?"),
    "leap": ("How many days are in", "a leap year?"),
    "rome": ("Can you tell me about the", "history of Rome?"),
    "bake": ("I would like to know how", "to bake bread."),
    "spanish": ("What is the best way to", "learn Spanish?"),
    "birds": ("Why do birds fly south in", "the winter?"),
    "ants": ("How do I get rid of", "ants in my kitchen?"),
    "frog": ("What is the difference between", "a frog and a toad?"),
    "octopus": ("Tell me a fun fact about", "octopuses."),
    "pasta": ("How long does it take to", "boil pasta?"),
    "beach": ("What should I pack for", "a beach holiday?"),
    "dough": ("Is it safe to eat", "raw cookie dough?"),
}

# The turns sets: six voices each, as (engine, voice, pace); the pace is hibari's speed (above 1 faster), Piper's
# length_scale (above 1 slower; joe's own is 1) or espeak-ng's words a minute.
Voice = tuple[str, str, float]
TURN_PAUSES_MS = (300, 400, 500, 600, 700, 800)
TURN_KINDS = ("preposition", "article", "conjunction", "verb", "clause", "filler")
TURNS: dict[str, dict] = {
    "turns-tune": {
        "voices": (
            ("hibari", "heart", 0.9),
            ("hibari", "heart", 1.0),
            ("piper", "joe", 1.0),
            ("espeak-ng", "en-us", 160),
            ("espeak-ng", "en-gb", 160),
            ("espeak-ng", "en-us+f3", 160),
        ),
        "pauses": {  # per kind, six (the phrase before the pause, the rest)
            "preposition": {
                "gift": ("What is a good gift for", "a ten year old?"),
                "mars": ("Can you tell me something about", "the planet Mars?"),
                "japan": ("What is the population of", "Japan?"),
                "salmon": ("What goes well with", "grilled salmon?"),
                "berlin": ("How far is it from Paris to", "Berlin?"),
                "chess": ("What are the rules of", "chess?"),
            },
            "article": {
                "table": ("How do I fix a", "wobbly table?"),
                "sound": ("What is the", "speed of sound?"),
                "movie": ("Can you recommend a", "movie for tonight?"),
                "bicycle": ("Who invented the", "bicycle?"),
                "landlord": ("How do I write a", "letter to my landlord?"),
                "canyon": ("What is the best time to visit the", "Grand Canyon?"),
            },
            "conjunction": {
                "climate": ("What is the difference between weather and", "climate?"),
                "eyes": ("Why do my eyes water and", "how can I stop it?"),
                "guitar": ("Should I learn the guitar or", "the piano first?"),
                "tired": ("I feel tired every afternoon because", "I wake up early. What can I do?"),
                "money": ("How do I save money if", "I earn very little?"),
                "marathon": ("I want to run a marathon but", "I have never run before. Where do I start?"),
            },
            "verb": {
                "glaciers": ("I would like to know", "how glaciers form."),
                "rainbow": ("Can you explain", "how a rainbow forms?"),
                "tokyo": ("Please tell me", "the time in Tokyo."),
                "eiffel": ("Do you know", "who built the Eiffel Tower?"),
                "puppy": ("Could you suggest", "a name for my puppy?"),
                "banana": ("I need", "a recipe for banana bread."),
            },
            "clause": {
                "penguins": ("Tell me a joke", "about penguins."),
                "salty": ("I would like to know why", "the ocean is salty."),
                "kettle": ("How do I make tea", "without a kettle?"),
                "madrid": ("What is the weather like", "in Madrid in April?"),
                "scotland": ("Can you help me", "plan a trip to Scotland?"),
                "orange": ("Give me a word", "that rhymes with orange."),
            },
            "filler": {
                "bird": ("What is the, um,", "biggest bird in the world?"),
                "stain": ("How do I, uh,", "get a stain out of a shirt?"),
                "rocket": ("Can you, um,", "tell me how a rocket gets to space?"),
                "catlife": ("I was wondering, uh,", "how long a cat lives."),
                "knees": ("Um, what is", "a good exercise for strong knees?"),
                "aurora": ("Where can I, um,", "see the northern lights?"),
            },
        },
        "finished": {
            "balloons": "How do hot air balloons fly?",
            "pacific": "What is the largest ocean on Earth?",
            "teeth": "How many teeth does an adult have?",
            "joke": "Tell me a joke.",
            "yawn": "Why do we yawn?",
            "kitten": "What is a good name for a kitten?",
            "grow": "How do I make my plants grow faster?",
            "thunder": "What causes thunder?",
            "photosynthesis": "Can you explain photosynthesis?",
            "astronaut": "Who was the first person on the moon?",
            "paperplane": "How do I fold a paper plane?",
            "cheetah": "How fast can a cheetah run?",
            "dinner": "What should I cook for dinner tonight?",
            "rain": "Is it going to rain tomorrow?",
            "snails": "How do snails move?",
            "iphone": "What year did the first iPhone come out?",
            "dream": "Why do we dream?",
            "whistle": "How do I whistle?",
        },
    },
    "turns-final": {
        "voices": (
            ("hibari", "heart", 1.15),
            ("hibari", "heart", 1.0),
            ("piper", "joe", 1.2),
            ("espeak-ng", "en-us", 160),
            ("espeak-ng", "en-gb-x-rp+m3", 160),
            ("espeak-ng", "en-us+f3", 140),
        ),
        "pauses": {
            "preposition": {
                "snack": ("What is a healthy snack for", "a long drive?"),
                "giraffes": ("Tell me something interesting about", "giraffes."),
                "guacamole": ("What is the main ingredient of", "guacamole?"),
                "airport": ("How do I get from the airport to", "the city centre?"),
                "spinach": ("What can I make with", "eggs and spinach?"),
                "king": ("Who was the first king of", "England?"),
            },
            "article": {
                "lemon": ("How do I plant a", "lemon tree?"),
                "river": ("What is the", "longest river in Africa?"),
                "riddle": ("Can you give me a", "riddle to solve?"),
                "gravity": ("Who discovered the", "law of gravity?"),
                "crane": ("How do I fold an", "origami crane?"),
                "library": ("Where is the", "oldest library in the world?"),
            },
            "conjunction": {
                "virus": ("What is the difference between a virus and", "a bacterium?"),
                "tomatoes": ("My tomato leaves are turning yellow and", "I want to know why."),
                "walk": ("Is it better to walk or", "to run if I want to lose weight?"),
                "noisy": ("I cannot sleep at night because", "the street is noisy. Any advice?"),
                "freeze": ("Can I freeze bread so", "it stays fresh longer?"),
                "swim": ("I want to learn to swim but", "I am afraid of water. What should I do?"),
            },
            "verb": {
                "vaccines": ("I would like to understand", "how vaccines work."),
                "tides": ("Could you explain", "how tides work?"),
                "fullmoon": ("Can you tell me", "when the next full moon is?"),
                "pyramids": ("I want to find out", "how old the pyramids are."),
                "cards": ("Would you recommend", "a card game for four people?"),
                "note": ("Help me write", "a short thank you note."),
            },
            "clause": {
                "mouse": ("Tell me a story", "about a brave little mouse."),
                "flamingos": ("I wonder why", "flamingos are pink."),
                "flight": ("How do I fall asleep", "on a long flight?"),
                "newyork": ("What time is it", "in New York right now?"),
                "homework": ("Can you give me a hand", "with my homework?"),
                "five": ("Explain gravity", "like I am five years old."),
            },
            "filler": {
                "herbs": ("What is, um,", "the best way to store fresh herbs?"),
                "glasses": ("How do I, uh,", "keep my glasses from fogging up?"),
                "painters": ("Could you, um,", "name three famous painters?"),
                "deep": ("I wanted to ask, uh,", "how deep the sea is."),
                "stars": ("Um, how many", "stars are in the sky?"),
                "batteries": ("Where do I, um,", "recycle old batteries?"),
            },
        },
        "finished": {
            "zebras": "Why do zebras have stripes?",
            "boat": "How do I make a paper boat?",
            "planet": "What is the hottest planet?",
            "story": "Tell me a story.",
            "whales": "How do whales breathe?",
            "coldest": "What is the coldest place on Earth?",
            "pizza": "How do I make pizza dough?",
            "snow": "Why is snow white?",
            "jupiter": "How many moons does Jupiter have?",
            "building": "What is the tallest building in the world?",
            "drawing": "How do I get better at drawing?",
            "austen": "Who wrote Pride and Prejudice?",
            "typing": "What is the best way to learn to type?",
            "naps": "Why do cats sleep so much?",
            "thermometer": "How does a thermometer work?",
            "italy": "What is the capital of Italy?",
            "pandas": "What do pandas eat?",
            "turtles": "How long do turtles live?",
        },
    },
}
FILLERS = {"um", "uh"}
VOICE_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "prompts" / "voice_prompts.jsonl"
SETS = {
    "questions": "assets/utterances",
    "heldout": "assets/utterances-heldout",
    "pauses": "assets/utterances-pauses",
    "turns-tune": "assets/utterances-turns-tune",
    "turns-final": "assets/utterances-turns-final",
    "turns-tune-flow": "assets/utterances-turns-tune-flow",
    "turns-final-flow": "assets/utterances-turns-final-flow",
}
FLOW = {"turns-tune-flow": "turns-tune", "turns-final-flow": "turns-final"}  # flow set -> the turns set it speaks
SILENT = 0.01  # a sample this quiet or quieter is silence (spoken() trims to the first and last louder one)
QUIET_S = 0.01  # the cut goes in the quietest stretch this long near the word boundary
GAP_MARGIN_S = 0.06  # ... searched from word n-1's end minus this to word n's start plus this
FALLBACK_S = 0.15  # ... or, where Whisper heard other words, this far either side of the boundary's timestamp
CUT_TRIES = 4  # places tried for the cut: the 3 quietest stretches, then the boundary's timestamp
ESPEAK_BREAK_EXTRA_MS = 2000  # see espeak_flow
PAUSE_TOLERANCE_MS = 20


class PiperPaced(PiperTTS):
    """PiperTTS at another length_scale (PiperTTS itself has no option for the pace; piper's synthesis has)."""

    def __init__(self, length_scale: float) -> None:
        super().__init__()
        from piper import SynthesisConfig  # installed with Piper, as PiperTTS imports it

        self._config = SynthesisConfig(length_scale=length_scale)

    def stream(self, text: str) -> Iterator[np.ndarray]:
        for chunk in self._voice.synthesize(text, syn_config=self._config):
            if chunk.audio_float_array.size:
                yield chunk.audio_float_array.astype(np.float32, copy=False)


class EspeakTTS(TTS):
    """An espeak-ng voice through its command (22.05 kHz): the robot voices a new user may try."""

    name = "espeak-ng"
    sample_rate = 22050

    def __init__(self, voice: str, words_per_minute: int) -> None:
        self._command = ["espeak-ng", "-v", voice, "-s", str(words_per_minute), "--stdout"]

    def stream(self, text: str) -> Iterator[np.ndarray]:
        wav = subprocess.run([*self._command, text], capture_output=True, check=True).stdout
        audio, rate = sf.read(io.BytesIO(wav), dtype="float32")
        assert rate == self.sample_rate, rate
        yield audio


def voice_label(voice: Voice) -> str:
    engine, name, pace = voice
    unit = {"hibari": "speed", "piper": "length_scale"}.get(engine)
    return f"{engine} {name} {unit} {pace:g}" if unit else f"{engine} {name} {pace:g} wpm"


def make_voice(voice: Voice) -> TTS:
    engine, _, pace = voice
    if engine == "hibari":
        return HibariTTS(speed=pace)
    if engine == "piper":
        return PiperTTS() if pace == 1 else PiperPaced(pace)
    return EspeakTTS(voice[1], int(pace))


def turns(which: str) -> dict[str, tuple[Voice, int, tuple[str, str] | str]]:
    """name -> (voice, pause in ms, (before, after) or the finished text). Voice, pause length and kind are crossed:
    the i-th paused turn takes voice i % 6, pause length i // 6 and kind (i + i // 6) % 6 (a Latin square); the
    finished questions take the voices in turn."""
    spec = TURNS[which]
    voices, kinds = spec["voices"], {kind: iter(spec["pauses"][kind].items()) for kind in TURN_KINDS}
    out: dict[str, tuple[Voice, int, tuple[str, str] | str]] = {}
    for i in range(len(voices) * len(TURN_PAUSES_MS)):
        name, said = next(kinds[TURN_KINDS[(i % len(voices) + i // len(voices)) % len(TURN_KINDS)]])
        out[name] = (voices[i % len(voices)], TURN_PAUSES_MS[i // len(voices)], said)
    for i, (name, text) in enumerate(spec["finished"].items()):
        out[name] = (voices[i % len(voices)], 0, text)
    return out


def turn_texts(which: str) -> dict[str, str]:
    return {name: said if isinstance(said, str) else " ".join(said) for name, (_, _, said) in turns(which).items()}


def check_turn_texts() -> None:
    """The turns sets share no sentence with each other, the other sets or the voice prompts (words compared)."""
    seen: dict[tuple[str, ...], str] = {}
    others = [*QUESTIONS.values(), *HELDOUT.values(), *(" ".join(p) for p in PAUSES.values())]
    if VOICE_PROMPTS.exists():
        others += [json.loads(line)["prompt"] for line in VOICE_PROMPTS.read_text().splitlines() if line.strip()]
    for text in others:
        seen[tuple(normalize_words(text))] = "another set or a voice prompt"
    for which in TURNS:
        for name, text in turn_texts(which).items():
            where = seen.setdefault(tuple(normalize_words(text)), f"{which}/{name}")
            if where != f"{which}/{name}":
                raise ValueError(f"{which}/{name} {text!r} is also in {where}")


def make_turns(which: str, out: Path, asr: Transcriber) -> int:
    """Write a turns set into out, with transcripts.json and turns.json; 0 even where some were misheard."""
    check_turn_texts()
    engines: dict[Voice, TTS] = {}
    transcripts, table = {}, {}
    heard_right: Counter[str] = Counter()
    said_by: Counter[str] = Counter()
    for name, (voice, pause_ms, said) in turns(which).items():
        if voice not in engines:
            engines[voice] = make_voice(voice)
        tts = engines[voice]
        if isinstance(said, tuple):
            text = " ".join(said)
            silence = np.zeros(pause_ms * SAMPLE_RATE // 1000, np.float32)
            audio16k = np.concatenate([spoken(tts, said[0]), silence, spoken(tts, said[1])])
        else:
            text = said
            audio16k = spoken(tts, text)
        label = voice_label(voice)
        transcripts[name] = text
        table[name] = {
            "text": text,
            "voice": label,
            "pause_ms": pause_ms,
            "pause_after": said[0] if isinstance(said, tuple) else None,
        }
        sf.write(out / f"{name}.wav", audio16k, SAMPLE_RATE, subtype="PCM_16")
        heard = asr.transcribe(audio16k)
        ok = normalize_words(heard) == normalize_words(text)  # as bench-voice's heard_right
        fillers_only = not ok and [w for w in normalize_words(heard) if w not in FILLERS] == [
            w for w in normalize_words(text) if w not in FILLERS
        ]
        heard_right[label] += ok
        said_by[label] += 1
        note = "" if ok else "  <-- MISHEARD (only a filler)" if fillers_only else "  <-- MISHEARD"
        print(f"{name} ({label}, pause {pause_ms} ms): {len(audio16k) / SAMPLE_RATE:.1f} s, heard {heard!r}{note}")
    (out / "transcripts.json").write_text(json.dumps(transcripts, indent=1) + "\n")
    (out / "turns.json").write_text(json.dumps(table, indent=1) + "\n")
    stale = sorted(wav.name for wav in out.glob("*.wav") if wav.stem not in transcripts)
    if stale:  # bench-voice replays every .wav in the folder
        print(f"warning: {out} also holds recordings of no turns set: {', '.join(stale)}")
    total = sum(heard_right.values())
    per_voice = ", ".join(f"{label} {heard_right[label]}/{n}" for label, n in said_by.items())
    print(f"heard right: {total}/{len(transcripts)} ({per_voice})")
    return 0  # a mishearing is what a new user's voice meets: reported, not a failure


def flow_turns(which: str) -> dict[str, tuple[Voice, int, tuple[str, str]]]:
    """The paused turns of turns set `which`: name -> (voice, pause in ms, (before, after)); no finished ones."""
    return {name: (voice, ms, said) for name, (voice, ms, said) in turns(which).items() if isinstance(said, tuple)}


def make_flow(which: str, out: Path, asr: Transcriber, aligner: Transcriber) -> int:
    """Write flow set `which` into out, with transcripts.json and turns.json; 1 if a silence is not pause_ms long
    (misheard words are reported, not failures). aligner places the pauses and hears the halves back, asr hears the
    whole recording as the other sets are heard."""
    check_turn_texts()
    engines: dict[Voice, TTS] = {}
    transcripts, table = {}, {}
    placed: Counter[str] = Counter()
    right: Counter[str] = Counter()  # "before", "after", "whole": heard as written
    heard_right: Counter[str] = Counter()
    said_by: Counter[str] = Counter()
    wrong_silence = []
    for name, (voice, pause_ms, said) in flow_turns(FLOW[which]).items():
        text, label = " ".join(said), voice_label(voice)
        if voice[0] == "espeak-ng":
            audio16k, at = espeak_flow(voice, said, pause_ms)
            how = "espeak-ng break"
            placed[how] += 1
        else:
            if voice not in engines:
                engines[voice] = make_voice(voice)
            sentence = spoken(engines[voice], text)
            cut, by, tried, errors, misheard = boundary_cut(sentence, said, aligner)
            audio16k, at = with_pause(sentence, cut, pause_ms)
            how = f"{by}, place {tried}, " + (
                f"halves heard with {errors} word errors" if errors else "halves heard right"
            )
            if misheard is not None:
                print(
                    f"warning: {which}/{name}.wav: Whisper heard {misheard!r}, not {text!r}: the pause was placed "
                    f"within {FALLBACK_S * 1000:.0f} ms of its boundary's timestamp"
                )
            if errors:
                print(f"warning: {which}/{name}.wav: no place tried was heard as the phrase, then the rest")
            placed[f"{by} (place {tried}{', halves misheard' if errors else ''})"] += 1
        start, end = longest_silence(audio16k)
        silence_ms = (end - start) * 1000 / SAMPLE_RATE
        silence_ok = start == at and abs(silence_ms - pause_ms) <= PAUSE_TOLERANCE_MS
        if not silence_ok:
            wrong_silence.append(name)
        sf.write(out / f"{name}.wav", audio16k, SAMPLE_RATE, subtype="PCM_16")
        transcripts[name] = text
        table[name] = {"text": text, "voice": label, "pause_ms": pause_ms, "pause_after": said[0], "style": "flow"}
        # Heard back: the audio before the silence should be the phrase, the audio after it the rest.
        notes = []
        for part, audio, expected, hearer in (
            ("before", audio16k[:at], said[0], aligner),
            ("after", audio16k[at + pause_ms * SAMPLE_RATE // 1000 :], said[1], aligner),
            ("whole", audio16k, text, asr),
        ):
            heard = hearer.transcribe(audio)
            ok, note = heard_as(heard, expected)
            right[part] += ok
            notes.append(f"{part} {heard!r}{note}")
        heard_right[label] += ok  # the whole, the last part
        said_by[label] += 1
        check = "" if silence_ok else f"  <-- NOT {pause_ms} ms (longest silence at {start / SAMPLE_RATE:.2f} s)"
        print(
            f"{name} ({label}, pause {pause_ms} ms): {len(audio16k) / SAMPLE_RATE:.1f} s, pause at "
            f"{at / SAMPLE_RATE:.2f} s ({how}), longest silence {silence_ms:.0f} ms{check}\n    " + "; ".join(notes)
        )
    (out / "transcripts.json").write_text(json.dumps(transcripts, indent=1) + "\n")
    (out / "turns.json").write_text(json.dumps(table, indent=1) + "\n")
    stale = sorted(wav.name for wav in out.glob("*.wav") if wav.stem not in transcripts)
    if stale:  # bench-voice replays every .wav in the folder
        print(f"warning: {out} also holds recordings of no flow set: {', '.join(stale)}")
    n = len(transcripts)
    print("placed: " + ", ".join(f"{k} {v}" for k, v in placed.items()))
    print(f"silence of pause_ms (within {PAUSE_TOLERANCE_MS} ms) and the longest: {n - len(wrong_silence)}/{n}")
    per_voice = ", ".join(f"{label} {heard_right[label]}/{k}" for label, k in said_by.items())
    print(
        f"heard as written: the phrase before the pause {right['before']}/{n}, the rest after it {right['after']}/{n}, "
        f"the whole {right['whole']}/{n} ({per_voice})"
    )
    if wrong_silence:
        print(f"silence not pause_ms: {', '.join(wrong_silence)}")
    return 1 if wrong_silence else 0


def heard_as(heard: str, text: str) -> tuple[bool, str]:
    """(heard as written, a note for the log), as make_turns judges it."""
    ok = normalize_words(heard) == normalize_words(text)
    fillers_only = not ok and [w for w in normalize_words(heard) if w not in FILLERS] == [
        w for w in normalize_words(text) if w not in FILLERS
    ]
    return ok, "" if ok else "  <-- MISHEARD (only a filler)" if fillers_only else "  <-- MISHEARD"


def espeak_flow(voice: Voice, said: tuple[str, str], pause_ms: int) -> tuple[np.ndarray, int]:
    """The sentence in one espeak-ng synthesis, with an SSML break after the phrase: (16 kHz audio with exactly
    pause_ms of silence at the break, where the silence starts). espeak-ng speaks on over a break without a full
    stop's fall (see the module docstring) and speaks the same samples before and after a break of any length (500
    and 2500 ms compared), so the break asked for is ESPEAK_BREAK_EXTRA_MS longer than the pause, surely the longest
    silence (a full stop in the rest makes one too), and is then cut to pause_ms."""
    _, name, pace = voice
    ssml = f'<speak>{escape(said[0])} <break time="{pause_ms + ESPEAK_BREAK_EXTRA_MS}ms"/> {escape(said[1])}</speak>'
    command = ["espeak-ng", "-m", "-v", name, "-s", str(int(pace)), "--stdout", ssml]
    audio, rate = sf.read(io.BytesIO(subprocess.run(command, capture_output=True, check=True).stdout), dtype="float32")
    audio16k = trimmed(to_mono_16k(audio, rate))
    start, end = longest_silence(audio16k)
    if (end - start) * 1000 < ESPEAK_BREAK_EXTRA_MS * SAMPLE_RATE:
        raise RuntimeError(f"espeak-ng made no silence of {ESPEAK_BREAK_EXTRA_MS} ms at the break in {ssml!r}")
    return with_pause(audio16k, start, pause_ms)


def boundary_cut(
    audio16k: np.ndarray, said: tuple[str, str], aligner: Transcriber
) -> tuple[int, str, int, int, str | None]:
    """Where to put the pause in the sentence's audio, between the phrase's last word and the rest's first:
    (sample, "word timestamps" or "fallback", which place tried it is, the word errors Whisper made hearing the two
    halves there, what Whisper heard in the whole where it heard other words than said).

    faster-whisper's word timestamps give the boundary: the gap between word n-1's end and word n's start, widened
    by GAP_MARGIN_S either side; where Whisper heard other words (a number written as digits is the same word), the
    boundary's timestamp in what it heard (matched_boundary), FALLBACK_S either side. The pause goes in the quietest
    QUIET_S there, but where two words run together the quietest stretch nearby is often a stop's closure inside a
    word ("for a | ten": the t's), so each place is tried in turn (cut_places: the quietest stretches, then the
    timestamp itself) until Whisper hears the phrase before it and the rest after it (fillers aside); if none is
    heard so, the first with the fewest word errors in the two halves."""
    want, n = normalize_words(" ".join(said)), len(normalize_words(said[0]))
    heard = timed_words(aligner, audio16k)
    if [w for w, _, _ in heard] == want:
        end, start = heard[n - 1][2], heard[n][1]  # word n-1's end and word n's start: the gap between them
        lo, hi, at = min(end, start) - GAP_MARGIN_S, max(end, start) + GAP_MARGIN_S, (end + start) / 2
        by, misheard = "word timestamps", None
    else:
        at = matched_boundary(want, n, heard, len(audio16k) / SAMPLE_RATE)
        lo, hi = at - FALLBACK_S, at + FALLBACK_S
        by, misheard = "fallback", " ".join(w for w, _, _ in heard)
    best = (0, 0, 1 << 30)  # place, its number, word errors
    for tried, cut in enumerate(cut_places(audio16k, lo, hi, at), 1):
        errors = sum(
            word_edits(" ".join(without_fillers(expected)), " ".join(without_fillers(aligner.transcribe(part))))[0]
            for part, expected in ((audio16k[:cut], said[0]), (audio16k[cut:], said[1]))
        )
        if errors < best[2]:
            best = (cut, tried, errors)
        if not errors:
            break
    return best[0], by, best[1], best[2], misheard


def without_fillers(text: str) -> list[str]:
    return [w for w in normalize_words(text) if w not in FILLERS]


def make_aligner() -> Transcriber:
    """Whisper base where its packages are installed, else tiny.en: base's word timestamps are closer (on "What is a
    good gift for a ten year old?", hibari 0.9: "for" ends at 0.96 s, where the audio shows it, in tiny.en's at 1.06
    s, after the "a" that follows)."""
    try:
        return Transcriber("base")
    except RuntimeError as e:
        print(f"note: placing the pauses with tiny.en's word timestamps, not base's ({e})")
        return Transcriber()


def timed_words(asr: Transcriber, audio16k: np.ndarray) -> list[tuple[str, float, float]]:
    """What faster-whisper hears, greedy, as (word, start s, end s), the words normalised as normalize_words does
    (one Whisper writes as several, "10-year-old", gives each of them its times)."""
    window = int(round((asr.window_s or 0) * SAMPLE_RATE))
    # Padded as Transcriber.transcribe pads: real silence, not zero features.
    audio = np.concatenate([audio16k, np.zeros(max(0, window - audio16k.size), np.float32)])
    segments, _ = asr._model.transcribe(
        audio, language="en", beam_size=1, word_timestamps=True, vad_filter=False, condition_on_previous_text=False
    )
    return [(w, t.start, t.end) for segment in segments for t in segment.words or () for w in normalize_words(t.word)]


def matched_boundary(want: list[str], n: int, heard: list[tuple[str, float, float]], duration_s: float) -> float:
    """The time of the boundary before want[n] where Whisper heard other words: want[n]'s start if Whisper heard that
    word (the words matched by difflib), else want[n-1]'s end, else between the nearest words it heard on either
    side, in proportion to the letters between them."""
    match = {}
    for block in difflib.SequenceMatcher(None, want, [w for w, _, _ in heard], autojunk=False).get_matching_blocks():
        match.update({block.a + k: block.b + k for k in range(block.size)})
    if n in match:
        return heard[match[n]][1]
    if n - 1 in match:
        return heard[match[n - 1]][2]
    before = max((i for i in match if i < n), default=None)
    after = min((i for i in match if i > n), default=None)
    t0, i0 = (heard[match[before]][2], before + 1) if before is not None else (0.0, 0)
    t1, i1 = (heard[match[after]][1], after) if after is not None else (duration_s, len(want))
    letters = [len(w) for w in want]
    return t0 + (t1 - t0) * sum(letters[i0:n]) / max(1, sum(letters[i0:i1]))


def cut_places(audio: np.ndarray, lo_s: float, hi_s: float, at_s: float) -> list[int]:
    """Samples to cut audio at, best first: in each of the CUT_TRIES - 1 quietest QUIET_S stretches between lo_s and
    hi_s (none overlapping), then within QUIET_S / 2 of at_s, the quietest sample (a cut there clicks least)."""
    win = int(QUIET_S * SAMPLE_RATE)

    def quietest_sample(a: int, b: int) -> int:
        a, b = max(1, a), min(len(audio) - 1, b)
        return a + int(np.argmin(np.abs(audio[a:b]))) if b > a else max(1, min(a, len(audio) - 1))

    lo, hi = max(1, int(lo_s * SAMPLE_RATE)), min(len(audio) - 1, int(hi_s * SAMPLE_RATE))
    places = []
    if hi - lo > win:
        power = np.convolve(audio[lo:hi].astype(np.float64) ** 2, np.ones(win), "valid")  # [i]: from lo + i
        for _ in range(CUT_TRIES - 1):
            i = int(np.argmin(power))
            if not np.isfinite(power[i]):
                break
            places.append(quietest_sample(lo + i, lo + i + win))
            power[max(0, i - win + 1) : i + win] = np.inf  # the stretches overlapping this one
    at = int(at_s * SAMPLE_RATE)
    places.append(quietest_sample(at - win // 2, at + win // 2))
    return list(dict.fromkeys(places))


def with_pause(audio: np.ndarray, at: int, pause_ms: int) -> tuple[np.ndarray, int]:
    """audio with pause_ms of zeros at sample `at` in place of the silent samples around it, so the silence there is
    exactly pause_ms long: (the audio, where the silence starts)."""
    quiet = np.abs(audio) <= SILENT
    start, end = at, at
    while start > 0 and quiet[start - 1]:
        start -= 1
    while end < len(audio) and quiet[end]:
        end += 1
    silence = np.zeros(pause_ms * SAMPLE_RATE // 1000, np.float32)
    return np.concatenate([audio[:start], silence, audio[end:]]), start


def longest_silence(audio: np.ndarray) -> tuple[int, int]:
    """(start, end) samples of the longest run of silent samples (|x| <= SILENT); (0, 0) if none."""
    edges = np.diff(np.concatenate([[0], (np.abs(audio) <= SILENT).astype(np.int8), [0]]))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    if not len(starts):
        return 0, 0
    i = int(np.argmax(ends - starts))
    return int(starts[i]), int(ends[i])


def spoken(tts: TTS, text: str) -> np.ndarray:
    """text in tts's voice at 16 kHz, without the silence it starts and ends with."""
    return trimmed(to_mono_16k(np.concatenate(list(tts.stream(text))), tts.sample_rate))


def trimmed(audio: np.ndarray) -> np.ndarray:
    """audio from its first to its last sample louder than SILENT."""
    loud = np.flatnonzero(np.abs(audio) > SILENT)
    return audio[loud[0] : loud[-1] + 1] if len(loud) else audio


def utterances(which: str) -> dict[str, str] | dict[str, tuple[str, str]]:
    return PAUSES if which == "pauses" else HELDOUT if which == "heldout" else QUESTIONS


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", default="questions", choices=list(SETS))
    parser.add_argument("--out", default=None, help="default: the set's folder in assets/")
    args = parser.parse_args()
    out = Path(args.out or SETS[args.set])
    out.mkdir(parents=True, exist_ok=True)
    if args.set in TURNS:
        return make_turns(args.set, out, Transcriber())
    if args.set in FLOW:
        return make_flow(args.set, out, Transcriber(), make_aligner())
    tts: TTS = PiperTTS() if args.set == "questions" else HibariTTS()
    asr = Transcriber()
    misheard, transcripts = 0, {}
    silence = np.zeros(int(PAUSE_S * SAMPLE_RATE), np.float32)
    for name, said in utterances(args.set).items():
        if isinstance(said, tuple):
            text = " ".join(said)
            audio16k = np.concatenate([spoken(tts, said[0]), silence, spoken(tts, said[1])])
        elif args.set == "questions":  # as the files were first made: the voice's own silences kept
            text = said
            audio16k = to_mono_16k(np.concatenate(list(tts.stream(text))), tts.sample_rate)
        else:
            text = said
            audio16k = spoken(tts, text)
        transcripts[name] = text
        sf.write(out / f"{name}.wav", audio16k, SAMPLE_RATE, subtype="PCM_16")
        heard = asr.transcribe(audio16k)
        ok = words(heard) == words(text)
        misheard += not ok
        print(f"{name}: {len(audio16k) / SAMPLE_RATE:.1f} s, heard {heard!r}{'' if ok else '  <-- MISHEARD'}")
    (out / "transcripts.json").write_text(json.dumps(transcripts, indent=1) + "\n")
    return 1 if misheard else 0


if __name__ == "__main__":
    sys.exit(main())
