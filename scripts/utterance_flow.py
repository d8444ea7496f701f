"""The flow sets' pause: one synthesis of the whole sentence, with exactly pause_ms of silence at the word boundary
after the phrase (the turns-*-flow sets in scripts/utterance_texts.py). espeak-ng puts it in through an SSML <break/>
(it speaks on with a non-final tune: on "What is the difference between weather and", en-us 160 wpm, the last word
holds at 92-97 Hz against 78-82 Hz spoken as a sentence of its own), hibari and Piper by cutting their sentence where
faster-whisper's word timestamps put the boundary. The quiet samples the voice itself left at the boundary are
replaced, so the silence there is exactly pause_ms.
"""

from __future__ import annotations

import difflib
import io
import subprocess
from xml.sax.saxutils import escape

import numpy as np
import soundfile as sf
from utterance_texts import FILLERS, Voice

from pipeline.asr import Transcriber
from pipeline.audio import SAMPLE_RATE, to_mono_16k
from pipeline.wer import normalize_words, word_edits

SILENT = 0.01  # a sample this quiet or quieter is silence (trimmed() trims to the first and last louder one)
QUIET_S = 0.01  # the cut goes in the quietest stretch this long near the word boundary
GAP_MARGIN_S = 0.06  # ... searched from word n-1's end minus this to word n's start plus this
FALLBACK_S = 0.15  # ... or, where Whisper heard other words, this far either side of the boundary's timestamp
CUT_TRIES = 4  # places tried for the cut: the 3 quietest stretches, then the boundary's timestamp
ESPEAK_BREAK_EXTRA_MS = 2000  # see espeak_flow


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


def trimmed(audio: np.ndarray) -> np.ndarray:
    """audio from its first to its last sample louder than SILENT."""
    loud = np.flatnonzero(np.abs(audio) > SILENT)
    return audio[loud[0] : loud[-1] + 1] if len(loud) else audio
