"""Write spoken questions for `say` and `bench-voice`, with their transcripts (transcripts.json).

- questions (assets/utterances): spoken by the Piper "joe" voice (a natural voice, so faster-whisper tiny.en hears
  the words; espeak-ng's robot voice was misheard in 5 of 8 questions). The tests replay these.
- heldout (assets/utterances-heldout): other questions in hibari's "heart" voice, which no test uses: the
  benchmarks' held-out set.
- pauses (assets/utterances-pauses): hibari "heart", each question cut after an unfinished phrase by exactly
  PAUSE_S of silence ("What is the capital of … Canada?"): a turn must not end at the pause.

Each file is resampled to 16 kHz mono 16-bit, transcribed back, and a mismatch is reported.

    python3 scripts/make_utterances.py [--set questions|heldout|pauses] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np
import soundfile as sf

from pipeline.asr import Transcriber
from pipeline.audio import SAMPLE_RATE, to_mono_16k
from pipeline.tts import TTS, HibariTTS, PiperTTS

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
SETS = {"questions": "assets/utterances", "heldout": "assets/utterances-heldout", "pauses": "assets/utterances-pauses"}


def spoken(tts: TTS, text: str) -> np.ndarray:
    """text in tts's voice at 16 kHz, without the silence it starts and ends with."""
    audio = to_mono_16k(np.concatenate(list(tts.stream(text))), tts.sample_rate)
    loud = np.flatnonzero(np.abs(audio) > 0.01)
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
