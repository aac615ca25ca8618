"""Seeded synthetic text (English-like prose, code, Chinese) to train the generated BPE on.

The text is a pure function of the arguments: only `random.Random(seed)` and ordered lists are
used, never set or hash order, so every process produces the same paragraphs.
"""

import itertools
import random

COMMON_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no will "
    "more can out up about into than them some could other what time only new do these two may "
    "first then any like my now over such our man me even most made after also did many before "
    "must through back years where much your way well down should because each just those people "
    "how too little state good very make world still own see men work long get here between both "
    "life being under never day same another know while last might us great old year off come "
    "since against go came right used take three model data value return string number list "
    "request server token cache memory batch layer weight error file system user function"
).split()

ONSETS = "b c d f g h j k l m n p r s t v w z bl br ch cl cr dr fl fr gl gr pl pr sc sh sk sl sp st str th tr".split()
VOWELS = "a e i o u a e i o ea ai ou io ie".split()
CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "nt", "st", "ng", "ck", "rt", "ll", "ss"]
SUFFIXES = ["", "", "", "", "s", "ed", "ing", "er", "ly", "tion", "ment", "ness", "able", "al", "ity"]

CODE_KEYWORDS = (
    "def return if else elif for while in import from class self None True False const let var "
    "function async await try except raise with as lambda yield int float str bool void struct "
    "static public private new null this print len range dict list tuple"
).split()

CJK_CHARS = (
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学"
    "对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头"
    "面公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向"
    "情部正名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信"
    "北少关并内加化由却代军产入先山五太水万市眼体别处总才场师书比住员九笑性通目华报立马命张活难"
    "模型数据服务器请求缓存计算内存批量权重错误文件系统用户函数调用工具天气北京上海深度学习"
)
HIRAGANA = "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわをん"
PUNCT_ZH = "，。、？！：；"


def _zipf_sampler(rng: random.Random, *tiers: list[str]):
    """Returns a function drawing items with Zipf weights; each tier is shuffled, earlier tiers rank higher."""
    order: list[str] = []
    for tier in tiers:
        tier = list(tier)
        rng.shuffle(tier)
        order += tier
    cum_weights = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(order))))
    return lambda: rng.choices(order, cum_weights=cum_weights)[0]


def _pseudo_words(rng: random.Random, count: int) -> list[str]:
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < count:
        num_syllables = rng.choice((1, 1, 2, 2, 2, 3))
        word = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(num_syllables))
        word += rng.choice(SUFFIXES)
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


class _TextMaker:
    def __init__(self, seed: int, num_words: int):
        self.rng = random.Random(seed)
        self.word = _zipf_sampler(self.rng, COMMON_WORDS, _pseudo_words(self.rng, num_words))
        self.keyword = _zipf_sampler(self.rng, CODE_KEYWORDS)
        cjk_lengths = [self.rng.choice((1, 2, 2, 3, 4)) for _ in range(num_words // 2)]
        self.cjk_word = _zipf_sampler(self.rng, ["".join(self.rng.choices(CJK_CHARS, k=k)) for k in cjk_lengths])

    def sentence(self) -> str:
        words = [self.word() for _ in range(self.rng.randint(4, 16))]
        words[0] = words[0].capitalize()
        if self.rng.random() < 0.3:
            words[self.rng.randrange(len(words))] += ","
        if self.rng.random() < 0.15:
            words.insert(self.rng.randrange(len(words)), str(self.rng.choice((1, 2, 3, 10, 42, 100, 2024, 3.5))))
        return " ".join(words) + self.rng.choice(".....?!:")

    def identifier(self) -> str:
        parts = [self.word() for _ in range(self.rng.choice((1, 1, 2, 2, 3)))]
        style = self.rng.random()
        if style < 0.5:
            return "_".join(parts)
        if style < 0.8:
            return parts[0] + "".join(p.capitalize() for p in parts[1:])
        return "".join(p.capitalize() for p in parts)

    def code_block(self) -> str:
        rng = self.rng
        lines = []
        indent = 0
        for _ in range(rng.randint(3, 12)):
            a, b = self.identifier(), self.identifier()
            template = rng.choice((
                "{kw} {a}({b}):", "{a} = {b}({n})", "return {a}.{b}", "if {a} == {n}:", "for {a} in {b}:",
                "self.{a} = {b}", "const {a} = await {b}(\"/{a}\");", "import {a}", "{a}[{n}] += {b};",
                "# {s}", "// {s}", "print(f\"{a}: {{{b}}}\")", "}} else {{", "int {a} = {n};",
            ))
            line = template.format(kw=self.keyword(), a=a, b=b, n=rng.randint(0, 4096), s=self.sentence())
            lines.append(" " * (4 * indent) + line)
            if line.endswith(":") or line.endswith("{"):
                indent = min(indent + 1, 4)
            elif rng.random() < 0.3:
                indent = max(indent - 1, 0)
        return "\n".join(lines) + "\n"

    def chinese(self) -> str:
        rng = self.rng
        words = [self.cjk_word() for _ in range(rng.randint(4, 20))]
        if rng.random() < 0.2:
            words.insert(rng.randrange(len(words)), "".join(rng.choices(HIRAGANA, k=rng.randint(2, 5))))
        return "".join(w + (rng.choice(PUNCT_ZH) if rng.random() < 0.15 else "") for w in words) + "。"

    def paragraph(self) -> str:
        kind = self.rng.random()
        if kind < 0.55:
            return " ".join(self.sentence() for _ in range(self.rng.randint(1, 6))) + "\n\n"
        if kind < 0.8:
            return self.code_block() + "\n"
        return self.chinese() + "\n"


def synthetic_paragraphs(seed: int, num_chars: int, num_words: int = 4000) -> list[str]:
    """Paragraphs of mixed prose, code and Chinese totalling about `num_chars` characters.

    A pure function of its arguments; `num_words` is the number of invented words to draw from.
    """
    maker = _TextMaker(seed, num_words)
    paragraphs: list[str] = []
    total = 0
    while total < num_chars:
        paragraphs.append(maker.paragraph())
        total += len(paragraphs[-1])
    return paragraphs
