"""
General RL: a chat instruction whose reward is rule-based, format, length and language rules mixed (GLM-5
report, arXiv 2602.15763, its general RL stage, which the report trains after reasoning and agentic RL; the
kinds of rule follow IFEval's verifiable instructions, Zhou et al. 2023, arXiv 2311.07911), one of the
environments of envs/ (the API is env_base.py's).

One turn, no tools. A task asks for a short reply to a name or about a topic, adds format, length and
language rules (listed at the rules section), and always asks for its content: the reply must mention the
name or the topic. Reward 1.0 when every rule holds, else 0.0, and the reason names the first rule that
failed. Difficulty 0 is the toy level, e.g. "Greet Mira in at most 4 words, ending with !" -> "Hello Mira!";
levels 1 to 5 are described at the tasks section.

Run:
    python -m envs                                                      # one task per environment
    python episodes.py 400 data/sft_general.jsonl --env general --difficulty 0   # SFT episodes
Tests: python -m pytest -q tests/test_envs.py
Honest limits: the rules check form, not meaning: "Mira!" greets Mira as far as they can tell, and any
words about tea make a list about tea; no reward model scores the rest, as a real general-RL stage would.
"Language" is script, case and digits, not a detector of English. The replies solve() writes are
templates, not prose.
"""

import re
import unicodedata

from envs.env_base import Env, boxed

# -----------------------------------------------------------------------------
# The rules: pure functions of the reply's text (and one argument), True when the rule holds
#
# Rules of three kinds:
# - format: a bulleted list of exactly N items; ending with "!" or with a given word; the name in \boxed{}
# - length: at most N words, or exactly N (a word is a whitespace-separated piece with a letter or a digit)
# - language: all lowercase, all capitals, no digits, or plain ASCII only (José must be written Jose)
#
# Every task also asks for its content: the reply must mention the name or the topic (in any case, accents or
# not), so an empty reply, or one that says the rules back, earns nothing. Reward 1.0 when every rule holds,
# else 0.0, and the reason names the first rule that failed. Each rule is a pure function of the reply's text.


def words(text):
    """The reply's words: whitespace-separated pieces with a letter or a digit ("-" and "!" alone are not)."""
    return [w for w in text.split() if any(c.isalnum() for c in w)]


def unaccent(text):
    """José -> Jose: accents dropped, case kept."""
    return "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c))


def mentions(text, word):
    """The word appears whole (Mira in "Mira's", not in "Miranda"), in any case, accents or not."""
    pattern = r"(?<!\w)" + re.escape(unaccent(word).casefold()) + r"(?!\w)"
    return re.search(pattern, unaccent(text).casefold()) is not None


def bullets(text, n):
    """Exactly n lines that start with "- " or "* ", each with a word in it (other lines may come too)."""
    items = [line for line in text.splitlines() if re.match(r"\s*[-*] ", line)]
    return len(items) == n and all(words(item) for item in items)


def ends_with(text, end):
    """The reply ends with `end` (any case, trailing spaces aside); a word must end the reply whole: "today"
    does not end "Mira, yesterday"."""
    t = text.rstrip()
    if len(t) < len(end) or t[-len(end) :].lower() != end.lower():
        return False
    return not (end[0].isalnum() and t[: -len(end)][-1:].isalnum())


def boxed_is(text, name):
    """Exactly one \\boxed{}, holding the name (any case, accents or not)."""
    return [unaccent(b).strip().casefold() for b in boxed(text)] == [unaccent(name).casefold()]


def max_words(text, n):
    return len(words(text)) <= n


def exact_words(text, n):
    return len(words(text)) == n


def lowercase(text, arg=None):
    return not any(c.isupper() for c in text)


def uppercase(text, arg=None):
    return not any(c.islower() for c in text)


def no_digits(text, arg=None):
    return not any(c.isdigit() for c in text)


def ascii_only(text, arg=None):
    return text.isascii()


# rule -> (its check, its phrase in the prompt and in the reason it failed, given the rule's argument)
RULES = {
    "mention": (mentions, "mention {}"),
    "bullets": (bullets, "as a bulleted list of exactly {} items, each on a line starting with '- '"),
    "end": (ends_with, "ending with {}"),
    "end_word": (ends_with, "ending with the word {}"),
    "boxed": (boxed_is, "with the name in \\boxed{{}}"),
    "max_words": (max_words, "in at most {} words"),
    "exact_words": (exact_words, "in exactly {} words"),
    "lowercase": (lowercase, "all in lowercase letters"),
    "uppercase": (uppercase, "all in capital letters"),
    "no_digits": (no_digits, "without any digits"),
    "ascii": (ascii_only, "in plain ASCII letters only (no accents)"),
}
LENGTH = ["max_words", "exact_words"]
LANGUAGE = ["lowercase", "uppercase", "no_digits", "ascii"]

# -----------------------------------------------------------------------------
# Tasks: what to write (a name to greet or thank, a topic to describe), the rules, and a reply keeping them
#
# Toy level (0): a length limit and one more rule over the shortest replies, e.g. "Greet Mira in at most 4
# words, ending with !" -> "Hello Mira!", over eight names and eight topics (128 prompts): a 3M-parameter
# model cannot yet copy a word it has not learned from its prompt, so the toy level's words are few enough to
# learn. Levels 1 to 5 mix two or three kinds (three from level 4) over longer replies, accented names and
# topics, and lists of up to four items.

NAMES = (
    "Mira Theo Lena Omar Ines Kai Nora Ravi Yuki Sami Zara Ada Hugo Lila Jonas Maya Elio Rosa Vera".split()
)
ACCENTED_NAMES = "José Zoë Renée Inès Chloé Noé".split()  # levels 1 to 5: the ASCII rule has teeth
TOPICS = "tea rain bread music snow honey soup jazz chess sleep wind fog milk rice cocoa silk".split()
# the toy level draws from eight of each: a 3M-parameter model cannot copy a word from its prompt yet (README,
# the RL section), so the name or topic it must mention has to come from a set small enough to learn, and to
# sample right sometimes on every prompt (GRPO learns only from what it samples)
TOY_NAMES = NAMES[:8]
TOY_TOPICS = TOPICS[:8]
ACCENTED_TOPICS = "café purée rosé crème jalapeño piñata".split()
THINGS = "map gift book song letter advice lunch tickets".split()
ADJECTIVES = "warm calm bright quiet simple fresh gentle lovely sweet soft clear pleasant".split()
GREETINGS = ["", ", welcome back", ", good to see you", ", I hope you are well", ", have a calm day"]
ENDINGS = "today indeed again now".split()


def general_task(rng, d):
    """A task at difficulty d -> (prompt, rules [(rule, argument)], a reply that keeps them all, mentions)."""
    names, topics = TOY_NAMES, TOY_TOPICS
    if d > 0:
        names, topics = NAMES + ACCENTED_NAMES, TOPICS + ACCENTED_TOPICS
    name, topic, thing = rng.choice(names), rng.choice(topics), rng.choice(THINGS)
    if d == 0:  # the toy level: a length limit, then one more rule, over the shortest replies
        form, length, language = None, "max_words", None
        extra = rng.choice(["end", "boxed", "lowercase", "uppercase"])
        if extra in ("lowercase", "uppercase"):
            family, language, kinds = "describe", extra, ["length", "language"]
        else:
            family, form, kinds = "greet", extra, ["length", "format"]
    else:
        family = rng.choice(["greet", "thank", "describe"])
        forms = ["bullets", "end", "end_word"] if family == "describe" else ["boxed", "end", "end_word"]
        form, length = rng.choice(forms), rng.choice(LENGTH)
        # capitals would turn \boxed into \BOXED, which is no box
        language = rng.choice([x for x in LANGUAGE if not (form == "boxed" and x == "uppercase")])
        count = 2
        if d >= 4:
            count = 3
        elif d >= 2:
            count = rng.randint(2, 3)
        kinds = rng.sample(["format", "length", "language"], count)  # in the order the prompt says them
        if "format" not in kinds:
            form = None
        if "language" not in kinds:
            language = None

    # the reply: its lines (one, or one per bullet), then the format, the language, the bullets' dashes
    n_items = rng.randint(2, 2 + d // 2) if form == "bullets" else 1
    if family == "greet":
        verb, said = f"Greet {name}", [name]
        lines = [f"Hello {name}" + (rng.choice(GREETINGS) if d else "")]
    elif family == "thank":
        verb, said = f"Thank {name} for the {thing}", [name, thing]
        lines = [f"Thank you for the {thing}, {name}"]
    else:
        verb, said = f"Describe {topic}", [topic]
        adjectives = rng.sample(ADJECTIVES, 4)
        if form == "bullets":
            lines = [f"{topic.capitalize()} is {a}" for a in adjectives[:n_items]]
        else:
            lines = [f"{topic.capitalize()} is " + " and ".join(adjectives[: 1 + rng.randint(0, min(d, 1))])]
    args = {"bullets": n_items, "end": "!", "end_word": rng.choice(ENDINGS), "boxed": name}
    if form == "boxed":
        lines[0] = lines[0].replace(name, f"\\boxed{{{name}}}", 1)
    if form == "end":
        lines[-1] += "!"
    elif form == "end_word":
        lines[-1] += " " + args["end_word"]
    elif form != "bullets":
        lines[-1] += "."
    if language == "lowercase":
        lines = [line.lower() for line in lines]
    elif language == "uppercase":
        lines = [line.upper() for line in lines]
    elif language == "ascii":
        lines = [unaccent(line) for line in lines]
    if form == "bullets":
        lines = [f"- {line}" for line in lines]
    reply = "\n".join(lines)

    # the length rule last: it counts the reply (at most: that count, or up to 3 more)
    n_words = len(words(reply))
    args["max_words"], args["exact_words"] = n_words + rng.randint(0, 3), n_words
    chosen = {"format": form, "length": length, "language": language}
    rules = [("mention", w) for w in said] + [(chosen[k], args.get(chosen[k])) for k in kinds]
    phrases = [RULES[r][1].format(a) for r, a in rules[len(said) :]]
    # "Greet Mira in at most 4 words, ..." but "Thank Mira for the map, ending with !": no map ends with it
    sep = " " if phrases[0].startswith(("in ", "as ")) else ", "
    prompt = verb + sep + ", ".join(phrases)
    return prompt, rules, reply, said


class GeneralEnv(Env):
    name, max_turns = "general", 1  # one reply, graded; a tool call (there are none) ends it unread

    def make_task(self, rng, d):
        prompt, rules, reply, said = general_task(rng, d)
        return {"prompt": prompt, "rules": rules, "reply": reply, "mentions": said}

    def grade(self, text):
        for rule, arg in self.task["rules"]:
            check, phrase = RULES[rule]
            if not check(text, arg):
                got = f" (the reply has {len(words(text))})" if rule in LENGTH else ""
                return 0.0, f"broke the rule: {phrase.format(arg)}{got}"
        return 1.0, "every rule holds"

    def solve(self):
        t = self.task
        phrases = [RULES[r][1].format(a) for r, a in t["rules"]]
        yield {
            "role": "assistant",
            "reasoning_content": f"Rules: {'; '.join(phrases)}. My reply has {len(words(t['reply']))} words.",
            "content": t["reply"],
        }
