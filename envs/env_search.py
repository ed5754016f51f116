"""
Search: an offline knowledge graph, multi-hop questions, the tools search/open/find (GLM-5 report, arXiv
2602.15763, its agentic RL sections: search environments), one of the environments of envs/.

A world from the seed (people, companies, universities, cities, countries), one page per entity; questions
with unique answers, because every hop is a function (one birthplace, one founder...). Levels 1 to 5: a
walk of min(d, 4) hops, sometimes ending in a number; the agent loop keeps the results of its last 5 tool
rounds and discards every round past 8,192 tokens of context (rollout.py). Toy level (0): a birth year,
population or founding year, copied from the hit of one search call.

Run: python -m envs (one task per environment; python rollout.py plays them through the agent loop)
Tests: python -m pytest -q tests/test_envs.py
Honest limits: a generated world, not the web; the search engine is word overlap, not BM25.
"""

import re

from envs.env_base import Env, boxed, call, made_up_word

# -----------------------------------------------------------------------------
# Search: an offline knowledge graph, multi-hop questions, search/open/find

# (relation, from type, to type, question phrase, sentence on the page of a, sentence on the page of b).
# Every relation is a function (one birthplace, one founder...), so every chain of them has one answer.
RELATIONS = [
    ("born_in", "person", "city", "the birthplace of {}", "{a} was born in {b}.", "{a} was born here."),
    ("works_at", "person", "company", "the employer of {}", "{a} works for {b}.", "{a} works here."),
    (
        "studied_at",
        "person",
        "university",
        "the alma mater of {}",
        "{a} studied at {b}.",
        "{a} studied here.",
    ),
    ("mentor", "person", "person", "the mentor of {}", "{a}'s mentor was {b}.", "{b} mentored {a}."),
    ("founder", "company", "person", "the founder of {}", "{a} was founded by {b}.", "{b} founded {a}."),
    (
        "hq",
        "company",
        "city",
        "the headquarters city of {}",
        "The headquarters of {a} are in {b}.",
        "{a} has its headquarters here.",
    ),
    (
        "location",
        "university",
        "city",
        "the home city of {}",
        "{a} is located in {b}.",
        "{a} is located here.",
    ),
    ("country", "city", "country", "the country of {}", "{a} lies in {b}.", "{a} is a city here."),
    (
        "capital",
        "country",
        "city",
        "the capital of {}",
        "The capital of {a} is {b}.",
        "It is the capital of {a}.",
    ),
]
ATTRIBUTES = {
    "person": ("born", "the birth year of {}", "{a} was born in the year {v}."),
    "company": ("founded", "the founding year of {}", "{a} was founded in the year {v}."),
    "city": ("population", "the population of {}", "{a} has {v} inhabitants."),
}


def make_world(rng, d):
    """{name: {"type": ..., relation: name, attribute: value}}: a small world, all names unique."""
    used = set()

    def name(suffixes=("",)):
        while True:
            n = made_up_word(rng).capitalize() + rng.choice(suffixes)
            if n not in used:
                used.add(n)
                return n

    countries = [name(("ia", "land", "stan")) for _ in range(2 + d // 2)]
    cities = [name() for _ in range(4 + d)]
    world = {c: {"type": "country"} for c in countries}
    for i, c in enumerate(cities):
        world[c] = {
            "type": "city",
            "country": countries[i % len(countries)],
            "population": rng.randint(20, 900) * 1000,
        }
    for k in countries:  # a capital among its own cities
        world[k]["capital"] = rng.choice([c for c in cities if world[c]["country"] == k])
    people = [f"{name()} {name()}" for _ in range(8 + 4 * d)]
    unis = [name((" Institute", " University")) for _ in range(2 + d // 2)]
    comps = [name((" Labs", " Works", " Systems", " Foods")) for _ in range(3 + d)]
    world |= {u: {"type": "university", "location": rng.choice(cities)} for u in unis}
    for i, p in enumerate(people):
        world[p] = {
            "type": "person",
            "born_in": rng.choice(cities),
            "works_at": rng.choice(comps),
            "studied_at": rng.choice(unis),
            "born": rng.randint(1940, 2000),
        }
        if i:  # a mentor from earlier in the list: no cycles
            world[p]["mentor"] = people[rng.randrange(i)]
    world |= {
        c: {
            "type": "company",
            "founder": rng.choice(people),
            "hq": rng.choice(cities),
            "founded": rng.randint(1950, 2020),
        }
        for c in comps
    }
    return world


def pages(world, rng):
    """One page per entity: its own facts (and, for people, a distractor), then the facts that point at it."""
    cities = [x for x in world if world[x]["type"] == "city"]
    text = {}
    for n, e in world.items():
        attr = ATTRIBUTES.get(e["type"])
        text[n] = [attr[2].format(a=n, v=e[attr[0]])] if attr else []
        text[n] += [fwd.format(a=n, b=e[rel]) for rel, _, _, _, fwd, _ in RELATIONS if rel in e]
        text[n] += [f"{n} once visited {rng.choice(cities)}."] if e["type"] == "person" else []
    for n, e in world.items():
        for rel, _, _, _, _, back in RELATIONS:
            if rel in e:
                text[e[rel]].append(back.format(a=n, b=e[rel]))
    return text


class SearchEnv(Env):
    name, max_turns, keep_recent = "search", 24, 5  # the report's keep-recent-k: the last 5 tool rounds
    context_threshold = 8192  # discard-all past this many tokens (ours: the report does not publish it)
    tools = [
        {
            "name": "search",
            "arguments": {"query": "words"},
            "description": "find pages whose titles or text match",
        },
        {
            "name": "open",
            "arguments": {"title": "a page title"},
            "description": "read a page, with line numbers",
        },
        {
            "name": "find",
            "arguments": {"pattern": "text"},
            "description": "lines of the open page that contain it",
        },
    ]

    def make_task(self, rng, d):
        self.world = make_world(rng, d)
        self.pages, self.open_page = pages(self.world, rng), None
        if d == 0:  # the toy level: a number that one search hit shows (the first line of its page)
            start = rng.choice(sorted(n for n in self.world if self.world[n]["type"] in ATTRIBUTES))
            attr = ATTRIBUTES[self.world[start]["type"]]
            self.tools = SearchEnv.tools[:1]  # search alone: a short tool list for the toy model's context
            return {
                "prompt": f"What is {attr[1].format(start)}? Search, then answer in \\boxed{{}}.",
                "answer": str(self.world[start][attr[0]]),
                "path": [start],
                "facts": [attr[2]],
            }
        while True:  # a random walk of 1 + d hops along functional relations, never revisiting an entity
            start = rng.choice(sorted(self.world))
            path, phrase, facts = [start], start, []
            for _ in range(min(d, 4)):
                rels = [
                    r
                    for r in RELATIONS
                    if r[1] == self.world[path[-1]]["type"]
                    and r[0] in self.world[path[-1]]
                    and self.world[path[-1]][r[0]] not in path
                ]
                if not rels:
                    break  # a dead end: walk again from another start
                rel = rng.choice(rels)
                path.append(self.world[path[-1]][rel[0]])
                phrase, facts = rel[3].format(phrase), facts + [rel[4]]
            else:
                break
        answer, attr = path[-1], ATTRIBUTES.get(self.world[path[-1]]["type"])
        if attr and rng.random() < 0.5:
            answer, phrase, facts = (
                str(self.world[path[-1]][attr[0]]),
                attr[1].format(phrase),
                facts + [attr[2]],
            )
        return {
            "prompt": f"What is {phrase}? Use the tools to look it up, then give the answer in \\boxed{{}}.",
            "answer": answer,
            "path": path,
            "facts": facts,  # the sentence read at each step
        }

    def run_tool(self, name, args):
        if name == "search":
            q = set(re.findall(r"\w+", args["query"].lower()))

            def score(t):  # title words count three times, page words once
                title = 3 * len(q & set(re.findall(r"\w+", t.lower())))
                return title + sum(len(q & set(re.findall(r"\w+", ln.lower()))) for ln in self.pages[t])

            top = 5 if self.difficulty else 2  # the toy model's context is short
            hits = sorted((t for t in self.pages if score(t)), key=lambda t: (-score(t), t))[:top]
            return "\n".join(f"{t}: {self.pages[t][0]}" for t in hits) or "no results"
        if name == "open":
            title = {t.lower(): t for t in self.pages}.get(args["title"].strip().lower())
            if not title:
                return f"no page titled {args['title']!r}; search first."
            self.open_page = title
            return f"# {title}\n" + "\n".join(f"{i + 1}: {ln}" for i, ln in enumerate(self.pages[title]))
        if not self.open_page:
            return "error: no page is open; use open first."
        page, pattern = self.pages[self.open_page], args["pattern"].lower()
        found = [f"{i + 1}: {ln}" for i, ln in enumerate(page) if pattern in ln.lower()]
        return "\n".join(found) or f"no line of {self.open_page} contains {args['pattern']!r}"

    def grade(self, text):
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        got = boxed(text) or [re.sub(r"(?i)^\s*answer\s*:", "", lines[-1]) if lines else ""]
        # two boxed answers give two normal forms, and a set of two never equals {want}
        norm = {" ".join(re.sub(r"[^\w\s'-]", " ", g).casefold().split()) for g in got}
        want = " ".join(self.task["answer"].casefold().split())
        return (1.0, "correct") if norm == {want} else (0.0, f"wrong: {' | '.join(got).strip()[:80]}")

    def solve(self):
        path, answer = self.task["path"], self.task["answer"]
        if self.difficulty == 0:
            obs = yield {
                "role": "assistant",
                "content": "",
                "tool_calls": [call("search", query=path[0])],
                "reasoning_content": f"I search for {path[0]}.",
            }
            line = next(ln for ln in obs[0].splitlines() if ln.startswith(path[0] + ":"))
            number = re.findall(r"\d+", line)[-1]  # the hit is the page's first line, its number
            yield {
                "role": "assistant",
                "content": f"\\boxed{{{number}}}",
                "reasoning_content": f"The hit says: {line.split(': ', 1)[1]} So the answer is {number}.",
            }
            return
        wanted = path[1:] + ([answer] if answer != path[-1] else [])  # what to read off each page in turn
        said = f"The question starts from {path[0]}."
        for a, b, fact in zip(path, wanted, self.task["facts"]):
            yield {
                "role": "assistant",
                "content": "",
                "tool_calls": [call("search", query=a)],
                "reasoning_content": f"{said} I search for {a}.",
            }
            yield {
                "role": "assistant",
                "content": "",
                "tool_calls": [call("open", title=a)],
                "reasoning_content": f"{a} has a page of its own; I open it.",
            }
            # the longest run of words around the fact's names
            kw = max((p.strip(" .") for p in re.split(r"\{[abv]\}", fact)), key=len)
            obs = yield {
                "role": "assistant",
                "content": "",
                "tool_calls": [call("find", pattern=kw)],
                "reasoning_content": f"I look for the line of {a}'s page that says {kw!r}.",
            }
            said = f"Line {next(ln for ln in obs[0].splitlines() if b in ln)} So this step gives {b}."
        yield {
            "role": "assistant",
            "content": f"\\boxed{{{answer}}}",
            "reasoning_content": f"{said} The chain {' -> '.join(path[:1] + wanted)} ends in the answer, "
            f"{answer}.",
        }
