"""The synthetic English -> German-like grammar fairseq-rope-generate-corpus draws its sentences
from: a small, regular fragment of German (verb-final subordinate clauses, verb brackets,
verb-second inversion, agreement over distance, numbers; the command's documentation lists what
each makes a model learn), deterministic for a seed."""

import random
from dataclasses import dataclass

# ---------------------------------------------------------------------------------------------
# Lexicon
# ---------------------------------------------------------------------------------------------

# (English singular, English plural, German singular, German plural, gender m/f/n)
NOUNS = [
    ("dog", "dogs", "Hund", "Hunde", "m"),
    ("man", "men", "Mann", "Männer", "m"),
    ("teacher", "teachers", "Lehrer", "Lehrer", "m"),
    ("friend", "friends", "Freund", "Freunde", "m"),
    ("neighbour", "neighbours", "Nachbar", "Nachbarn", "m"),
    ("doctor", "doctors", "Arzt", "Ärzte", "m"),
    ("farmer", "farmers", "Bauer", "Bauern", "m"),
    ("king", "kings", "König", "Könige", "m"),
    ("bird", "birds", "Vogel", "Vögel", "m"),
    ("tree", "trees", "Baum", "Bäume", "m"),
    ("letter", "letters", "Brief", "Briefe", "m"),
    ("car", "cars", "Wagen", "Wagen", "m"),
    ("cat", "cats", "Katze", "Katzen", "f"),
    ("woman", "women", "Frau", "Frauen", "f"),
    ("student", "students", "Studentin", "Studentinnen", "f"),
    ("city", "cities", "Stadt", "Städte", "f"),
    ("door", "doors", "Tür", "Türen", "f"),
    ("flower", "flowers", "Blume", "Blumen", "f"),
    ("street", "streets", "Straße", "Straßen", "f"),
    ("lamp", "lamps", "Lampe", "Lampen", "f"),
    ("bottle", "bottles", "Flasche", "Flaschen", "f"),
    ("queen", "queens", "Königin", "Königinnen", "f"),
    ("mouse", "mice", "Maus", "Mäuse", "f"),
    ("school", "schools", "Schule", "Schulen", "f"),
    ("child", "children", "Kind", "Kinder", "n"),
    ("house", "houses", "Haus", "Häuser", "n"),
    ("book", "books", "Buch", "Bücher", "n"),
    ("horse", "horses", "Pferd", "Pferde", "n"),
    ("girl", "girls", "Mädchen", "Mädchen", "n"),
    ("window", "windows", "Fenster", "Fenster", "n"),
    ("picture", "pictures", "Bild", "Bilder", "n"),
    ("boat", "boats", "Boot", "Boote", "n"),
    ("apple", "apples", "Apfel", "Äpfel", "m"),
    ("village", "villages", "Dorf", "Dörfer", "n"),
    ("glass", "glasses", "Glas", "Gläser", "n"),
    ("bed", "beds", "Bett", "Betten", "n"),
]

# Transitive verbs: (en base, en 3sg, en participle, de 3sg, de 3pl, de participle)
VERBS = [
    ("see", "sees", "seen", "sieht", "sehen", "gesehen"),
    ("find", "finds", "found", "findet", "finden", "gefunden"),
    ("buy", "buys", "bought", "kauft", "kaufen", "gekauft"),
    ("like", "likes", "liked", "mag", "mögen", "gemocht"),
    ("visit", "visits", "visited", "besucht", "besuchen", "besucht"),
    ("paint", "paints", "painted", "malt", "malen", "gemalt"),
    ("carry", "carries", "carried", "trägt", "tragen", "getragen"),
    ("hear", "hears", "heard", "hört", "hören", "gehört"),
    ("follow", "follows", "followed", "verfolgt", "verfolgen", "verfolgt"),
    ("wash", "washes", "washed", "wäscht", "waschen", "gewaschen"),
    ("sell", "sells", "sold", "verkauft", "verkaufen", "verkauft"),
    ("search", "searches", "searched", "sucht", "suchen", "gesucht"),
    ("greet", "greets", "greeted", "grüßt", "grüßen", "gegrüßt"),
    ("draw", "draws", "drawn", "zeichnet", "zeichnen", "gezeichnet"),
    ("open", "opens", "opened", "öffnet", "öffnen", "geöffnet"),
    ("build", "builds", "built", "baut", "bauen", "gebaut"),
    ("forget", "forgets", "forgotten", "vergisst", "vergessen", "vergessen"),
    ("hold", "holds", "held", "hält", "halten", "gehalten"),
]
# Infinitives (for modal constructions) are the German 3pl forms above.

# Modals: (en 3sg phrase, en 3pl phrase, de 3sg, de 3pl)
MODALS = [
    ("wants to", "want to", "will", "wollen"),
    ("can", "can", "kann", "können"),
    ("must", "must", "muss", "müssen"),
    ("should", "should", "soll", "sollen"),
]

# (English, German stem)
ADJECTIVES = [
    ("big", "groß"), ("small", "klein"), ("old", "alt"), ("young", "jung"), ("new", "neu"),
    ("red", "rot"), ("green", "grün"), ("blue", "blau"), ("beautiful", "schön"),
    ("fast", "schnell"), ("quiet", "leise"), ("strange", "seltsam"), ("clever", "klug"),
    ("tired", "müde"), ("happy", "glücklich"), ("dark", "dunkel"), ("cheap", "billig"),
    ("famous", "berühmt"),
]

# Prepositions governing the dative: (English, German)
PREPOSITIONS = [
    ("behind", "hinter"), ("with", "mit"), ("next to", "neben"), ("in front of", "vor"),
    ("under", "unter"), ("near", "bei"), ("after", "nach"),
]

# Fronted adverbs that trigger verb-second inversion in German main clauses.
ADVERBS = [
    ("today", "heute"), ("yesterday", "gestern"), ("tomorrow", "morgen"), ("often", "oft"),
    ("perhaps", "vielleicht"), ("suddenly", "plötzlich"), ("unfortunately", "leider"),
    ("in the morning", "morgens"),
]

# Subordinating conjunctions: the German clause they introduce is verb-final.
SUBORDINATORS = [
    ("because", "weil"), ("although", "obwohl"), ("while", "während"), ("when", "wenn"),
    ("if", "falls"),
]
# Main-clause verbs that take a "that"-clause: (en 3sg, en 3pl, de 3sg, de 3pl)
SAY_VERBS = [
    ("says", "say", "sagt", "sagen"), ("thinks", "think", "glaubt", "glauben"),
    ("knows", "know", "weiß", "wissen"), ("hopes", "hope", "hofft", "hoffen"),
]
COORDINATORS = [("and", "und"), ("but", "aber")]

EN_UNITS = ["", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
EN_TEENS = ["ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
            "seventeen", "eighteen", "nineteen"]
EN_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
DE_UNITS = ["", "eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun"]
DE_TEENS = ["zehn", "elf", "zwölf", "dreizehn", "vierzehn", "fünfzehn", "sechzehn", "siebzehn",
            "achtzehn", "neunzehn"]
DE_TENS = ["", "", "zwanzig", "dreißig", "vierzig", "fünfzig", "sechzig", "siebzig", "achtzig",
           "neunzig"]

# German articles by (case, gender or "pl")
DEF_ART = {
    "nom": {"m": "der", "f": "die", "n": "das", "pl": "die"},
    "acc": {"m": "den", "f": "die", "n": "das", "pl": "die"},
    "dat": {"m": "dem", "f": "der", "n": "dem", "pl": "den"},
}
INDEF_ART = {
    "nom": {"m": "ein", "f": "eine", "n": "ein"},
    "acc": {"m": "einen", "f": "eine", "n": "ein"},
    "dat": {"m": "einem", "f": "einer", "n": "einem"},
}


def cardinal(n: int, units, teens, tens, compound) -> str:
    """The word for 2..99 from a language's words for units, teens and tens;
    ``compound(tens_word, unit)`` joins the two parts of 21..99 that are not a multiple of ten."""
    if n < 10:
        return units[n]
    if n < 20:
        return teens[n - 10]
    ten, unit = divmod(n, 10)
    return compound(tens[ten], unit) if unit else tens[ten]


def en_number(n: int) -> str:
    """English cardinal for 2..99: twenty-one."""
    return cardinal(n, EN_UNITS, EN_TEENS, EN_TENS, lambda tens, unit: f"{tens}-{EN_UNITS[unit]}")


def de_number(n: int) -> str:
    """German cardinal for 2..99: units come before tens (21 -> einundzwanzig)."""
    return cardinal(n, DE_UNITS, DE_TEENS, DE_TENS,
                    lambda tens, unit: ("ein" if unit == 1 else DE_UNITS[unit]) + "und" + tens)


def adjective_ending(det: str, case: str, gender: str) -> str:
    """German adjective ending after a definite article ("def"), an indefinite one ("indef") or
    none ("none", only plural here)."""
    if gender == "pl":
        if det == "def":
            return "en"
        return "en" if case == "dat" else "e"  # strong plural: große Hunde, großen Hunden
    if det == "def":
        if case == "nom" or (case == "acc" and gender in "fn"):
            return "e"
        return "en"
    # indefinite (mixed declension)
    if case == "dat":
        return "en"
    if gender == "f":
        return "e"
    if gender == "m":
        return "er" if case == "nom" else "en"
    return "es"


def inflect_adjective(stem: str, ending: str) -> str:
    if stem.endswith("e"):  # leise -> leisen / leiser / leises
        return stem + ending[1:] if ending.startswith("e") else stem + ending
    if stem.endswith("el"):  # dunkel -> dunkle
        return stem[:-2] + "l" + ending
    return stem + ending


# ---------------------------------------------------------------------------------------------
# Grammar
# ---------------------------------------------------------------------------------------------


@dataclass
class NP:
    en: str
    de: str
    plural: bool


@dataclass
class Clause:
    """A clause in both languages. German clause orders are built by the caller:
    ``de_subject``, ``de_finite``, ``de_middle`` (objects, PPs) and ``de_final`` (participle or
    infinitive, possibly empty)."""
    en: str
    de_subject: str
    de_finite: str
    de_middle: str
    de_final: str

    def de_main(self) -> str:  # verb second: S V_fin O PP V_inf
        return " ".join(x for x in (self.de_subject, self.de_finite, self.de_middle, self.de_final) if x)

    def de_inverted(self, fronted: str) -> str:  # fronted adverb, then V_fin S O PP V_inf
        return " ".join(x for x in (fronted, self.de_finite, self.de_subject, self.de_middle, self.de_final) if x)

    def de_subordinate(self) -> str:  # verb final: S O PP V_inf V_fin
        return " ".join(x for x in (self.de_subject, self.de_middle, self.de_final, self.de_finite) if x)


class Grammar:
    def __init__(self, rng: random.Random):
        self.rng = rng

    def noun_phrase(self, case: str, allow_number: bool = True) -> NP:
        rng = self.rng
        en_sg, en_pl, de_sg, de_pl, gender = rng.choice(NOUNS)
        n_adj = rng.choices([0, 1, 2], weights=[5, 4, 1])[0]
        adjs = rng.sample(ADJECTIVES, n_adj)
        kind = rng.choices(["def", "indef", "plural_def", "number"], weights=[5, 3, 3, 2 if allow_number else 0])[0]
        if kind == "def":
            det_en, det_de, det, g, plural = "the", DEF_ART[case][gender], "def", gender, False
        elif kind == "indef":
            det_en = "an" if (adjs[0][0] if adjs else en_sg)[0] in "aeiou" else "a"
            det_de, det, g, plural = INDEF_ART[case][gender], "indef", gender, False
        elif kind == "plural_def":
            det_en, det_de, det, g, plural = "the", DEF_ART[case]["pl"], "def", "pl", True
        else:
            n = rng.randint(2, 99)
            if rng.random() < 0.3:
                det_en = det_de = str(n)
            else:
                det_en, det_de = en_number(n), de_number(n)
            det, g, plural = "none", "pl", True
        ending = adjective_ending(det, case, g)
        en_words = [det_en] + [a[0] for a in adjs] + [en_pl if plural else en_sg]
        noun_de = de_pl if plural else de_sg
        if plural and case == "dat" and not noun_de.endswith(("n", "s")):
            noun_de += "n"  # dative plural: den Hunden
        de_words = [det_de] + [inflect_adjective(a[1], ending) for a in adjs] + [noun_de]
        return NP(" ".join(en_words), " ".join(de_words), plural)

    def prepositional_phrases(self):
        count = self.rng.choices([0, 1, 2], weights=[6, 3, 1])[0]
        en, de = [], []
        for _ in range(count):
            prep_en, prep_de = self.rng.choice(PREPOSITIONS)
            np_ = self.noun_phrase("dat", allow_number=False)
            en.append(f"{prep_en} {np_.en}")
            de.append(f"{prep_de} {np_.de}")
        return " ".join(en), " ".join(de)

    def clause(self) -> Clause:
        rng = self.rng
        subj = self.noun_phrase("nom")
        obj = self.noun_phrase("acc")
        pp_en, pp_de = self.prepositional_phrases()
        v_base, v_3sg, v_part, de_3sg, de_3pl, de_part = rng.choice(VERBS)
        tense = rng.choices(["present", "perfect", "modal"], weights=[4, 3, 2])[0]
        pl = subj.plural
        if tense == "present":
            en_verb = v_base if pl else v_3sg
            de_fin, de_final = (de_3pl if pl else de_3sg), ""
        elif tense == "perfect":
            en_verb = ("have " if pl else "has ") + v_part
            de_fin, de_final = ("haben" if pl else "hat"), de_part
        else:
            m_sg, m_pl, dm_sg, dm_pl = rng.choice(MODALS)
            en_verb = (m_pl if pl else m_sg) + " " + v_base
            de_fin, de_final = (dm_pl if pl else dm_sg), de_3pl
        en = " ".join(x for x in (subj.en, en_verb, obj.en, pp_en) if x)
        de_middle = " ".join(x for x in (obj.de, pp_de) if x)
        return Clause(en, subj.de, de_fin, de_middle, de_final)

    def sentence(self):
        """One sentence pair (English, German), detokenized, first letter capitalised."""
        rng = self.rng
        first = self.clause()
        form = rng.choices(["main", "adverb", "subordinate", "that", "coordinated", "long"],
                           weights=[3, 2, 3, 2, 2, 2])[0]
        if form == "main":
            en, de = first.en, first.de_main()
        elif form == "adverb":
            adv_en, adv_de = rng.choice(ADVERBS)
            en, de = f"{adv_en} {first.en}", first.de_inverted(adv_de)
        elif form == "subordinate":
            sub = self.clause()
            conj_en, conj_de = rng.choice(SUBORDINATORS)
            en = f"{first.en}, {conj_en} {sub.en}"
            de = f"{first.de_main()}, {conj_de} {sub.de_subordinate()}"
        elif form == "that":
            speaker = self.noun_phrase("nom", allow_number=False)
            say_sg, say_pl, dsay_sg, dsay_pl = rng.choice(SAY_VERBS)
            en = f"{speaker.en} {say_pl if speaker.plural else say_sg} that {first.en}"
            de = f"{speaker.de} {dsay_pl if speaker.plural else dsay_sg}, dass {first.de_subordinate()}"
        elif form == "coordinated":
            second = self.clause()
            conj_en, conj_de = rng.choice(COORDINATORS)
            en = f"{first.en}{',' if conj_en == 'but' else ''} {conj_en} {second.en}"
            de = f"{first.de_main()}, {conj_de} {second.de_main()}"
        else:  # adverb + main clause + subordinate clause + coordinated clause
            adv_en, adv_de = rng.choice(ADVERBS)
            sub, third = self.clause(), self.clause()
            conj_en, conj_de = rng.choice(SUBORDINATORS)
            en = f"{adv_en} {first.en}, {conj_en} {sub.en}, and {third.en}"
            de = f"{first.de_inverted(adv_de)}, {conj_de} {sub.de_subordinate()}, und {third.de_main()}"
        return _capitalise(en) + ".", _capitalise(de) + "."


def _capitalise(text: str) -> str:
    return text[:1].upper() + text[1:]


def generate(seed: int, sizes):
    """Return {split: [(en, de), ...]} for ``sizes`` = [(split, n), ...]. Pairs are unique
    across all splits, so valid and test never overlap train."""
    grammar = Grammar(random.Random(seed))
    seen = set()
    out = {}
    for split, n in sizes:
        pairs = []
        attempts = 0
        while len(pairs) < n:
            attempts += 1
            if attempts > 50 * n + 1000:
                raise RuntimeError(f"could not draw {n} distinct sentences for {split}")
            pair = grammar.sentence()
            if pair[0] in seen:
                continue
            seen.add(pair[0])
            pairs.append(pair)
        out[split] = pairs
    return out
