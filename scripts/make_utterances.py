"""Write spoken questions for `say` and `bench-voice`, with their transcripts (transcripts.json).

The sets' texts, and what each set is: scripts/utterance_texts.py; the flow sets' pause: scripts/utterance_flow.py.

Each file is resampled to 16 kHz mono 16-bit, transcribed back, and a mismatch is reported (for the turns sets it
does not fail the script: a summary line counts who was heard right, per voice).

    python3 scripts/make_utterances.py [--set questions|heldout|pauses|turns-tune|turns-final|turns-tune-flow|
        turns-final-flow] [--out DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import soundfile as sf
from utterance_flow import FALLBACK_S, boundary_cut, espeak_flow, longest_silence, make_aligner, trimmed, with_pause
from utterance_texts import FILLERS, HELDOUT, PAUSE_S, PAUSES, QUESTIONS, TURN_KINDS, TURN_PAUSES_MS, TURNS, Voice

from pipeline.asr import Transcriber
from pipeline.audio import SAMPLE_RATE, to_mono_16k
from pipeline.tts import TTS, HibariTTS, PiperTTS
from pipeline.wer import normalize_words

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


def spoken(tts: TTS, text: str) -> np.ndarray:
    """text in tts's voice at 16 kHz, without the silence it starts and ends with."""
    return trimmed(to_mono_16k(np.concatenate(list(tts.stream(text))), tts.sample_rate))


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
