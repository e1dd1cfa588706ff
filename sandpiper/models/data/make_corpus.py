"""Generate ``corpus.txt``, the tokenizer training text shipped with Sandpiper.

The tiny model's byte-level BPE tokenizer is trained on this file (see
:mod:`sandpiper.models.tiny`). The text is produced deterministically from the templates and
word lists below (``random.Random(0)``), so regenerating it gives the same bytes. It mixes
plain English, Python and shell code, arithmetic with ``\\boxed{}`` answers and Hermes-style
tool calls and tool responses, which is what the agent loop renders.

Regenerate with::

    python -m sandpiper.models.data.make_corpus   # writes sandpiper/models/data/corpus.txt
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CORPUS_PATH = Path(__file__).with_name("corpus.txt")


def _words(text: str, sep: str | None = None) -> list[str]:
    return text.split(sep)


_NOUNS = _words(
    "agent model policy sandbox file folder test reward answer question river mountain bird "
    "city garden kitchen window teacher student engineer library number list table column "
    "value result error message server client token container shell script function class "
    "module package record store learner collector version step batch sample group episode "
    "task prompt tool command output input line word book letter story morning evening "
    "apple bridge candle desert engine forest harbor island jacket ladder meadow needle ocean "
    "pencil quarter rabbit saddle tunnel umbrella valley wagon yard zebra account balance "
    "budget channel decision example feature gateway history instance journal keyboard "
    "language machine network object pattern question reason signal template update variable "
    "weather year answer argument boundary contract default estimate fraction gradient "
    "hypothesis interval kernel latency memory notebook optimizer parameter query register "
    "schedule thread upload vector window worker buffer cache daemon format header index "
    "matrix node queue route socket stack string timer tuple archive checkpoint dataset "
    "experiment metric baseline benchmark pipeline storage database transaction"
)
_ADJECTIVES = _words(
    "small large quick slow bright quiet careful simple complex green blue old new empty full "
    "correct wrong local remote early late strong gentle tiny long short clear noisy "
    "ancient brave calm dark eager famous golden hidden honest icy jolly kind lazy modern narrow "
    "orange polite rapid rare silent sharp smooth stable sudden tall useful vast warm wide young "
    "broken cheap distant exact fresh heavy hollow light loud nervous patient precise random "
    "rough shallow sparse steady strange sweet thick thin valid visible wooden yellow"
)
_VERBS = _words(
    "reads writes checks builds runs opens closes finds moves keeps returns prints counts sorts "
    "loads saves starts stops watches solves answers asks learns follows repeats fixes "
    "accepts borrows carries delivers explains gathers handles ignores joins measures notices "
    "orders paints receives selects teaches updates visits wraps compares converts describes "
    "evaluates filters generates imports merges normalizes predicts rejects samples trains "
    "validates caches compiles deploys formats indexes parses queries renders schedules"
)
_ADVERBS = _words(
    "quickly slowly carefully again often rarely always quietly twice gladly barely "
    "eventually honestly loudly neatly politely seldom suddenly together usually"
)
_PLACES = [
    "in the morning",
    "at the station",
    "near the river",
    "on the server",
    "inside the sandbox",
    "after lunch",
    "before the test",
    "during the run",
]
_EXTRA_WORDS = _words(
    "about above across action active actual address adjust admit adult advice affect afford "
    "afraid after against agree ahead allow almost alone along already also although amount "
    "animal annual another anyone appear apply approach area army around arrive article artist "
    "assume attack attention author available avoid away baby back bank base beat beautiful "
    "because become before begin behavior behind believe benefit best better between beyond "
    "bill billion black blood board body born both break bring brother build business "
    "call camera campaign cancer capital card care career case catch cause cell center central "
    "century certain chair challenge chance change character charge child choice choose church "
    "citizen civil claim clearly close coach cold collection college color come commercial "
    "common community company compare computer concern condition conference congress consider "
    "consumer contain continue control cost could country couple course court cover create crime "
    "cultural culture cup current customer cut daughter dead deal death debate decade decide "
    "deep defense degree democrat describe design despite detail determine develop difference "
    "different difficult dinner direction director discover discuss disease doctor dog door "
    "down draw dream drive drop drug during each economic economy edge education effect effort "
    "eight either election else employee energy enjoy enough enter entire environment especially "
    "establish even event ever every everybody everyone everything evidence exactly exist expect "
    "experience expert explain face fact factor fail fall family far fast father fear federal "
    "feel feeling few field fight figure fill film final finally financial fine finger finish "
    "fire firm first fish five floor fly focus food foot force foreign forget form former "
    "forward four free friend front fund future game garden general generation girl give glass "
    "goal good government great ground grow growth guess gun guy hair half hand hang happen "
    "happy hard have head health hear heart heat help here herself high himself his hit hold "
    "home hope hospital hot hotel hour house however huge human hundred husband idea identify "
    "image imagine impact important improve include including increase indeed indicate "
    "individual industry information inside instead institution interest interesting "
    "international interview into investment involve issue item itself job join just keep key "
    "kid kill kind knowledge land large last late later laugh law lawyer lay lead leader learn "
    "least leave left leg legal less let level life light like likely limit listen little live "
    "long look lose loss lot love low magazine main maintain major majority make manage "
    "management manager many market marriage material matter maybe mean measure media medical "
    "meet meeting member memory mention method middle might military million mind minute miss "
    "mission moment money month more most mother mouth move movement movie much music must "
    "myself name nation national natural nature near nearly necessary need never news newspaper "
    "next nice night none nor north note nothing notice now officer official often oil once "
    "only onto open operation opportunity option order organization other others outside over "
    "own owner page pain painting paper parent part participant particular partner party pass "
    "past patient pay peace people perform performance perhaps period person personal phone "
    "physical pick picture piece place plan plant play player point police political popular "
    "population position positive possible power practice prepare present president pressure "
    "pretty prevent price private probably problem process produce product production "
    "professional professor program project property protect prove provide public pull purpose "
    "push quality quickly quite race radio raise range rate rather reach ready real reality "
    "realize really receive recent recently recognize record reduce reflect region relate "
    "relationship religious remain remember remove report represent require research resource "
    "respond response responsibility rest return reveal rich right rise risk road rock role room "
    "rule safe same save scene school science scientist score season seat second section "
    "security seek seem sell send senior sense series serious serve service seven several "
    "shake share she shoot shot should shoulder show side sign significant similar simply since "
    "sing single sister sit site situation size skill skin social society soldier some somebody "
    "someone something sometimes song soon sort sound source south southern space speak special "
    "specific speech spend sport spring staff stage stand standard star state statement station "
    "stay still stock street structure study stuff style subject success successful such suffer "
    "suggest summer support sure surface system talk tax teach team technology television tell "
    "tend term terms than thank their them themselves then theory there these they thing think "
    "third this those though thought thousand threat three through throughout throw thus today "
    "together tonight total tough toward town trade traditional training travel treat treatment "
    "tree trial trip trouble true truth try turn type under understand unit until upon usually "
    "various very victim view violence visit voice vote wait walk wall want war watch water way "
    "weapon wear week weight well west western what whatever wheel when where whether which "
    "while white whole whom whose why wife will win wind wish with within without woman wonder "
    "work world worry would write writer wrong yeah yes yet you young your yourself"
)
_NAMES = _words("Ada Alan Grace Linus Barbara Edsger Donald Margaret Ken Dennis")
_FUNCS = _words(
    "add multiply count_words reverse_list is_even parse_line mean clamp fib gcd lcm "
    "flatten chunked merge_dicts read_config normalize_path load_json dump_csv median "
    "is_prime factorial binary_search bubble_sort tokenize strip_comments word_count "
    "to_snake_case rolling_mean top_k unique_items safe_divide"
)
_SHELL = [
    "ls -la",
    "pwd",
    "cat README.md",
    "python3 -c 'print(1 + 2)'",
    "grep -rn TODO src/",
    "find . -name '*.py' | head",
    "wc -l data.txt",
    "mkdir -p out && echo done > out/status.txt",
    "python3 solution.py < input.txt",
    "sed -n 1,20p main.py",
    "echo $((6 * 7))",
    "head -n 5 notes.txt",
]


def _sentence(rng: random.Random) -> str:
    subject = rng.choice(
        [f"the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}", rng.choice(_NAMES)]
    )
    text = f"{subject} {rng.choice(_VERBS)} the {rng.choice(_NOUNS)}"
    if rng.random() < 0.5:
        text += f" {rng.choice(_ADVERBS)}"
    if rng.random() < 0.4:
        text += f" {rng.choice(_PLACES)}"
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "!", "?"])


def _definition(rng: random.Random) -> str:
    word = rng.choice(_EXTRA_WORDS)
    others = " ".join(rng.sample(_EXTRA_WORDS, 6))
    return f'The word "{word}" often appears near {others}. {_sentence(rng)}'


def _paragraph(rng: random.Random) -> str:
    return " ".join(_sentence(rng) for _ in range(rng.randint(3, 7)))


def _python(rng: random.Random) -> str:
    name = rng.choice(_FUNCS)
    a, b = rng.sample(["x", "y", "n", "items", "value", "count", "text"], 2)
    op = rng.choice(["+", "-", "*", "//", "%"])
    body = rng.choice(
        [
            f"    return {a} {op} {b}",
            f"    total = 0\n    for i in range({a}):\n        total += i {op} {b}\n    return total",
            f"    if {a} > {b}:\n        return {a}\n    return {b}",
            f"    result = [{a} for {a} in {b} if {a}]\n    return len(result)",
        ]
    )
    call = f"print({name}({rng.randint(0, 99)}, {rng.randint(1, 99)}))"
    return f'def {name}({a}, {b}):\n    """{_sentence(rng)}"""\n{body}\n\n\n{call}\n'


def _math(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(1, 99)
    op, value = rng.choice([("+", a + b), ("-", a - b), ("*", a * b), ("%", a % b)])
    return f"Question: What is {a} {op} {b}?\nAnswer: {a} {op} {b} = {value}. The answer is \\boxed{{{value}}}.\n"


def _tool_exchange(rng: random.Random) -> str:
    command = rng.choice(_SHELL)
    call = {"name": "execute_bash", "arguments": {"command": command}}
    if rng.random() < 0.3:
        call = {
            "name": "str_replace_editor",
            "arguments": {"command": "view", "path": f"/workspace/{rng.choice(_FUNCS)}.py"},
        }
    output = rng.choice(
        ["", "done", str(rng.randint(0, 500)), _sentence(rng), "No such file or directory"]
    )
    system = ""
    if rng.random() < 0.3:
        system = (
            "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\nYou may call one or "
            "more functions to assist with the user query.<|im_end|>\n"
            f"<|im_start|>user\n{_sentence(rng)} Please use the tools.<|im_end|>\n"
        )
    return system + (
        f"<|im_start|>assistant\nLet me run a command.\n<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>\n"
        f"<|im_start|>user\n<tool_response>\n{output}\n</tool_response><|im_end|>\n"
    )


def generate(n_blocks: int = 3000, seed: int = 0) -> str:
    """Return the corpus text: ``n_blocks`` blocks of mixed prose, code, math and tool use."""
    rng = random.Random(seed)
    makers = [_paragraph, _paragraph, _definition, _python, _math, _math, _tool_exchange]
    return "\n".join(rng.choice(makers)(rng) for _ in range(n_blocks))


if __name__ == "__main__":
    CORPUS_PATH.write_text(generate())
    print(f"wrote {CORPUS_PATH} ({CORPUS_PATH.stat().st_size} bytes)")
