"""The text `bmoe-bench quality` scores by default, and the prompts of its greedy generations.

Written for bmoe's quality harness and used nowhere else: in particular not in
bmoe.demo.calibration_text, from which the demo model's routers were built, so a demo model has
not been fitted to it. Plain English prose of several kinds (narrative, explanation, a short
dialogue, a list of steps), about 900 tokens with SmolLM2's tokenizer: enough for a context of
128 tokens and 512 scored ones after it.
"""

from __future__ import annotations

TEXT = """\
The ferry across the Orme had run for ninety years before anyone thought to write down how it
worked. It was a flat wooden deck the size of two farm carts, guided by a steel rope stretched from
bank to bank, and it moved by the river itself: the ferryman turned a wheel that set the deck at an
angle to the current, and the water, pushing against the slanted hull, carried the whole thing
sideways along the rope. On a calm morning the crossing took four minutes. After heavy rain it could
take twenty, and on three or four days a year it did not run at all.

Agnes Ward took over the wheel from her uncle in the spring she turned nineteen. He had taught her
the angles by feel rather than by number, standing behind her with one hand on the spokes and
saying "more" or "less" until the deck hummed the way he liked. What he could not teach her was the
river's memory. A flood in March left gravel bars that shifted the fast water toward the west bank
for months afterwards, and a dry August pulled the current into a narrow channel where the rope
sagged low enough to touch the surface. Agnes began to keep a notebook. Each crossing got a line:
the time, the height of the water on the painted post by the landing, the angle of the wheel, the
number of minutes, and anything odd, such as a log caught on the rope or a heron standing where it
had never stood before.

By the end of her first year the notebook held more than three thousand lines, and a pattern had
begun to show in them. The crossing was slowest not when the river was highest, as everyone in the
village assumed, but two days after the highest water, when the flood had dropped and left the
deepest channel full of fast, narrow current. She told this to the schoolteacher, who told it to
the county engineer, who came out in a borrowed car and spent a whole afternoon reading her pages on
the landing with his hat pushed back.

"You understand what you have here," he said at last. "This is a record of the river's bed that no
survey could give us. Every time the bottom moves, your minutes change."

"I only wanted to know when to warn people that they would be late," Agnes said.

"That too," he said, and asked if he could copy it.

Rivers shape their beds in a way that is easy to describe and hard to predict. Water moving quickly
can lift sand and small stones; water slowing down drops them. On the outside of a bend the current
runs faster and cuts into the bank, while on the inside it slows and builds a beach. Over years a
bend creeps sideways across its valley, leaving a trail of old channels behind it. A single flood
can undo the work of a decade, straightening one loop and starting another, and the people who live
beside a river learn to read it the way sailors learn to read weather: by small signs, collected
patiently, long before they can say why they mean what they mean.

The engineer's copy of the notebook ended up in a report about whether to replace the ferry with a
bridge. The report recommended a bridge, and the bridge was built eleven years later, two miles
downstream where the banks were rock. Agnes ran the ferry until the week the bridge opened. On the
last day the whole village crossed, a few at a time, although most of them had nowhere in
particular to go on the other side.

If you want to keep a record like hers, a few habits help more than any instrument:

1. Write the entry at the same moment every time, before you have a chance to forget or tidy it.
2. Measure the same things in the same way, even when they seem boring, because the boring days are
   the ones that let you see the strange ones.
3. Note what surprised you in plain words; numbers tell you that something changed, words often tell
   you what.
4. Read the whole record again now and then, from the beginning, slowly.

The notebook itself is in the county archive now, in a grey box with a typed label. Its pages are
soft at the corners from being turned on a wet deck, and on one of them, next to a crossing that
took nineteen minutes in a November gale, someone has drawn a very small, very careful heron.
"""

PROMPTS: tuple[str, ...] = (
    "The old map showed a path through the marsh that nobody had walked for years, so",
    "Here is a simple explanation of why the sky changes colour at sunset:",
    "Dear neighbours, the garden committee would like to remind everyone that",
)
