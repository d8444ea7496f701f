"""Write assets/utterances: spoken questions for `say` and `bench-voice`, with their transcripts.

Spoken by the Piper "joe" voice (a natural voice, so faster-whisper tiny.en hears the words; espeak-ng's robot
voice was misheard in 5 of 8 questions, and answers to misheard questions are not what users ask), then
resampled to 16 kHz mono 16-bit. Each file is transcribed back and a mismatch is reported.

    python3 scripts/make_utterances.py [--out assets/utterances]
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
from pipeline.tts import PiperTTS

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


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="assets/utterances")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tts, asr = PiperTTS(), Transcriber()
    misheard = 0
    for name, text in QUESTIONS.items():
        audio = np.concatenate(list(tts.stream(text)))
        audio16k = to_mono_16k(audio, tts.sample_rate)
        sf.write(out / f"{name}.wav", audio16k, SAMPLE_RATE, subtype="PCM_16")
        heard = asr.transcribe(audio16k)
        ok = words(heard) == words(text)
        misheard += not ok
        print(f"{name}: {len(audio16k) / SAMPLE_RATE:.1f} s, heard {heard!r}{'' if ok else '  <-- MISHEARD'}")
    (out / "transcripts.json").write_text(json.dumps(QUESTIONS, indent=1) + "\n")
    return 1 if misheard else 0


if __name__ == "__main__":
    sys.exit(main())
