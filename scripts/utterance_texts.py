"""The texts the project's recordings speak, and what each set is; scripts/make_utterances.py makes the recordings.
Pure data, every value a literal: commands/corpus.py reads QUESTIONS, HELDOUT and PAUSES with ast (without importing)
to keep the recordings' texts out of the training corpus.

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
  one synthesis with exactly pause_ms of silence at the word boundary after the phrase (scripts/utterance_flow.py).
  turns.json adds "style": "flow".
"""

from __future__ import annotations

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
