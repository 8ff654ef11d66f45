"""Calibration text for the demo model's routers (`bmoe-demo`).

Original passages written for bmoe (no third-party text), covering the kinds of input a small
chat model meets: stories, science facts, history, geography, code, cooking, how-to steps,
letters, arithmetic and chat dialogues. The routers are k-means centroids of the hidden states
these passages produce, so variety here is what makes routing depend on what is being said.

`PASSAGES` holds plain text; `DIALOGUES` holds chat turns, rendered with the model's own chat
template before calibration. Changing any of it changes the demo model's bytes: bump
`bmoe.demo.write.RECIPE` with it, so cached demo models (named by recipe) are rebuilt.
"""

from __future__ import annotations

PASSAGES: tuple[str, ...] = (
    # --- stories -----------------------------------------------------------------------------
    """The lighthouse keeper's daughter, Mara, had never seen the mainland. Every morning she
climbed the hundred and twelve steps to polish the great lens, and every evening she watched the
ferry lights crawl along the far shore like a line of patient beetles. One winter the ferry did
not come. A storm had torn the cable from the landing, and the island's supplies ran low: the
flour went first, then the lamp oil, then the tea her father could not live without. Mara found
an old chart in the cellar, soft as cloth, on which someone had drawn a dotted path across the
shallows, marked only at low tide. She waited for the moon to pull the sea back, tied a lantern
to her belt, and walked. The sand hissed under her boots. Crabs clicked in the dark. Twice the
water rose to her knees and she thought of turning back, but the dotted line held, rock to rock,
all the way to a fishing village whose people stared at her as if she had stepped out of the
sea itself. She came home two days later in a borrowed boat, with flour, oil, tea, and a
stranger's promise to mend the cable before spring.""",
    """Old Tomas kept a bakery at the corner of Wren Street, and he had one rule: the first loaf
of the day went to whoever was waiting outside when he opened the shutter. Usually it was the
postman. Sometimes it was a nurse coming off the night shift. One foggy Tuesday it was a small
boy in a coat three sizes too large, holding a coin he had clearly been saving for a long time.
Tomas wrapped the loaf, refused the coin, and asked the boy his name. "Felix," said the boy,
"and I'm going to be a baker too." From then on Felix came every Tuesday. By the time he was
twelve he could shape a plait better than Tomas's own hands, which had begun to shake. By the
time he was twenty the sign above the door had a second name painted on it, slightly crooked,
in letters that Tomas insisted on painting himself.""",
    """The robot had been built to sort parcels, so when the warehouse closed it did the only
thing it knew: it sorted. It sorted the leaves that blew in through the broken skylight by
colour, then by size, then by the number of points on each edge. It sorted the pigeons, though
the pigeons did not cooperate. When a girl named Ines climbed in through a window one afternoon,
looking for somewhere quiet to read, the robot rolled over and asked which shelf she belonged on.
She laughed and said she belonged on the shelf for people who ask too many questions. The robot
considered this for eleven seconds, cleared a shelf, and labelled it carefully: QUESTIONS. Ines
came back every day after that, and slowly the shelf filled up with her questions, written on
scraps of cardboard, waiting for answers.""",
    # --- science -----------------------------------------------------------------------------
    """Water is one of the few substances that expands when it freezes. In liquid water the
molecules tumble past each other, held loosely by hydrogen bonds that form and break billions of
times a second. As the temperature drops toward zero degrees Celsius, those bonds settle into a
hexagonal lattice that holds the molecules further apart than they were in the liquid. That is
why ice floats, why pipes burst in winter, and why lakes freeze from the top down, leaving
liquid water underneath where fish can survive until spring. If ice sank, many lakes would
freeze solid from the bottom up, and life in cold climates would look very different.""",
    """The Sun is a star of average size, about four and a half billion years old. At its core,
hydrogen nuclei fuse into helium at a temperature of roughly fifteen million degrees, releasing
the energy that eventually reaches us as sunlight. Light leaving the Sun's surface takes about
eight minutes and twenty seconds to reach the Earth, so when you look at a sunset you are seeing
the Sun as it was a little over eight minutes ago. The planets closest to the Sun are Mercury and
Venus; Mars, Jupiter, Saturn, Uranus and Neptune lie further out. Jupiter is so large that all
the other planets together would fit inside it with room to spare.""",
    """Plants make their own food through photosynthesis. Inside the leaves, tiny structures
called chloroplasts contain chlorophyll, a green pigment that absorbs red and blue light. The
plant uses that energy to split water molecules, releasing oxygen into the air, and to combine
carbon dioxide into sugars. Those sugars feed the plant's growth and are stored in roots, seeds
and fruit. Nearly every food chain on land begins with this process, and most of the oxygen we
breathe was released by plants and by tiny ocean organisms called phytoplankton.""",
    """The human heart beats about one hundred thousand times a day. It has four chambers: two
atria that receive blood and two ventricles that pump it out. The right side sends blood to the
lungs to pick up oxygen, and the left side, which has thicker muscle walls, pushes that
oxygen-rich blood through the rest of the body. Valves between the chambers keep the blood moving
in one direction, and the familiar heartbeat sound is the noise of those valves closing. Regular
exercise, sleep and a diet low in processed food all help keep the heart healthy.""",
    """Electricity flows when electrons move through a conductor such as copper wire. Voltage is
the push that drives them, current is the rate at which charge flows, and resistance is how much
the material opposes that flow. Ohm's law ties the three together: voltage equals current times
resistance. A battery supplies a steady voltage from a chemical reaction, while the outlets in a
house supply alternating current, which reverses direction fifty or sixty times every second
depending on the country.""",
    # --- history and geography ---------------------------------------------------------------
    """The printing press changed Europe faster than almost any invention before it. Before the
middle of the fifteenth century, books were copied by hand, which made them rare and expensive.
Movable metal type allowed a workshop to print hundreds of identical pages in a day. Within fifty
years presses were running in more than two hundred cities, and millions of books were in
circulation. Cheaper books spread literacy, helped scientists share their results, and allowed
new religious and political ideas to travel further than any preacher could walk.""",
    """Ancient Egypt grew along the Nile, a river that flooded every summer and left a layer of
rich black soil on its banks. Farmers planted wheat and barley in that soil and measured the
height of the flood to predict the harvest. The pharaohs built pyramids as tombs, the largest of
which stands at Giza near modern Cairo. Egyptian scribes wrote in hieroglyphs, a script that
combined pictures and sounds, and for centuries nobody could read it, until a stone carved with
the same decree in three scripts gave scholars the key.""",
    """Paris is the capital of France and its largest city, built on both banks of the river
Seine. It is famous for the Eiffel Tower, the Louvre museum, the cathedral of Notre-Dame and its
cafes and bakeries. Rome is the capital of Italy, Madrid is the capital of Spain, and Berlin is
the capital of Germany. Tokyo, the capital of Japan, is one of the largest cities in the world,
while Canberra was chosen as the capital of Australia as a compromise between Sydney and
Melbourne. Ottawa is the capital of Canada, and Brasilia, a planned city, became the capital of
Brazil in 1960.""",
    """The Silk Road was not a single road but a web of trade routes linking China with Central
Asia, Persia and the Mediterranean. Merchants rarely travelled its whole length; goods passed
from hand to hand, city to city, on the backs of camels and in the holds of river boats. Silk,
paper and porcelain moved west, while glass, silver, horses and wool moved east. Along with the
goods travelled ideas, languages, recipes and religions, and some historians argue that the
exchange of ideas mattered more than the trade itself.""",
    # --- code --------------------------------------------------------------------------------
    """def word_counts(text):
    \"\"\"Return a dictionary mapping each lowercase word to how often it appears.\"\"\"
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,!?;:\\"'()")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts


def top_words(text, n=5):
    counts = word_counts(text)
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:n]


if __name__ == "__main__":
    sample = "The cat sat on the mat. The dog sat on the cat."
    for word, count in top_words(sample):
        print(f"{word}: {count}")""",
    """// Debounce: run `fn` only after `wait` milliseconds have passed without another call.
function debounce(fn, wait) {
  let timer = null;
  return function (...args) {
    clearTimeout(timer);
    timer = setTimeout(() => fn.apply(this, args), wait);
  };
}

const search = debounce((query) => {
  fetch(`/api/search?q=${encodeURIComponent(query)}`)
    .then((response) => response.json())
    .then((results) => render(results))
    .catch((error) => console.error("search failed:", error));
}, 300);

document.querySelector("#search").addEventListener("input", (event) => {
  search(event.target.value);
});""",
    """-- Monthly revenue per customer, only for customers with more than three orders.
SELECT c.name,
       strftime('%Y-%m', o.created_at) AS month,
       SUM(o.total) AS revenue,
       COUNT(*) AS orders
FROM customers AS c
JOIN orders AS o ON o.customer_id = c.id
WHERE o.status = 'paid'
GROUP BY c.id, month
HAVING COUNT(*) > 3
ORDER BY month, revenue DESC;""",
    """#!/bin/sh
# Back up the notes folder into a dated archive and keep only the last seven archives.
set -eu
src="$HOME/notes"
dest="$HOME/backups"
mkdir -p "$dest"
stamp=$(date +%Y-%m-%d)
tar -czf "$dest/notes-$stamp.tar.gz" -C "$src" .
ls -1t "$dest"/notes-*.tar.gz | tail -n +8 | xargs -r rm --
echo "backup written to $dest/notes-$stamp.tar.gz\"""",
    """A linked list stores its items in nodes, where each node holds a value and a pointer to
the next node. Inserting at the front takes constant time, because only one pointer changes, but
finding the tenth item means walking past the first nine. An array, by contrast, keeps its items
side by side in memory, so reaching any index is immediate, while inserting in the middle means
shifting everything after it. Choosing between them depends on which operations a program does
most often.""",
    # --- cooking -----------------------------------------------------------------------------
    """Simple tomato soup for four. Warm two tablespoons of olive oil in a large pot over medium
heat. Add one chopped onion and two sliced cloves of garlic and cook, stirring now and then,
until the onion is soft and golden, about eight minutes. Tip in two tins of chopped tomatoes, a
teaspoon of sugar, a pinch of salt and half a litre of vegetable stock. Let it simmer gently for
twenty minutes, then blend until smooth. Taste, add black pepper and a little more salt if it
needs it, and serve with a swirl of cream and a handful of torn basil leaves. Crusty bread on the
side is not optional.""",
    """To make pancakes, whisk two eggs with three hundred millilitres of milk. Sift in one
hundred and fifty grams of flour, a teaspoon of baking powder and a pinch of salt, and whisk
until the batter is smooth with no lumps. Let it rest for ten minutes while a frying pan heats on
the stove. Brush the pan with a little butter, pour in a small ladle of batter, and cook until
bubbles appear on the surface and the edges look dry, then flip and cook the other side for
another minute. Keep the finished pancakes warm in a low oven and serve them with lemon and
sugar, maple syrup, or fresh berries.""",
    """A good kitchen knife does more for a home cook than any gadget. Keep it sharp, because a
dull blade slips off the skin of a tomato and is more likely to cut a finger than a sharp one.
Hold the food with your fingertips curled under, so the flat of the blade rests against your
knuckles. Wash the knife by hand, dry it straight away, and store it on a magnetic strip or in a
block rather than loose in a drawer, where the edge gets knocked against other utensils.""",
    # --- how-to, letters, everyday writing ----------------------------------------------------
    """How to change a bicycle tyre. First shift onto the smallest gear, open the brake, and
remove the wheel. Let out any remaining air, then push the tyre bead toward the centre of the
rim all the way around, which gives you slack. Hook a tyre lever under the bead, lever it over
the rim, and slide a second lever around until one side of the tyre comes free. Pull out the old
tube, run your fingers carefully around the inside of the tyre to find the thorn or glass that
caused the puncture, and remove it. Put a little air into the new tube so it holds its shape,
tuck it in, and work the bead back on with your thumbs. Inflate to the pressure printed on the
side of the tyre and refit the wheel.""",
    """Dear Ms. Alvarez,

Thank you for meeting with me on Thursday to discuss the community garden project. As we
agreed, I have attached a revised plan that moves the raised beds closer to the water tap and
adds a shaded seating area for older visitors. The local hardware shop has offered to donate
timber if we can collect it before the end of the month. Could you let me know whether the
council needs a separate application for the seating area, or whether it can be included in the
original permit? I would be happy to come in again if that is easier.

Kind regards,
Daniel Okafor""",
    """Meeting notes, product team, Monday. Attendees: Priya, Sam, Jonas, Lea. The login bug
reported last week is fixed and will ship on Wednesday. Sam raised that the new onboarding
screens confuse first-time users; Lea will run five short interviews before we change anything.
Jonas asked for a decision on the mobile release date. We agreed to move it two weeks later to
leave room for testing on older phones. Action items: Priya updates the roadmap, Sam drafts the
interview questions, Jonas prepares the release checklist.""",
    # --- arithmetic and reasoning -------------------------------------------------------------
    """A train leaves the station at nine o'clock travelling at eighty kilometres per hour. A
second train leaves the same station one hour later on a parallel track at one hundred and
twenty kilometres per hour. When does the second train catch up? By ten o'clock the first train
is eighty kilometres ahead. The second train closes the gap at forty kilometres per hour, the
difference between their speeds, so it needs two hours. It catches up at twelve o'clock, two
hundred and forty kilometres from the station.""",
    """If a shirt costs twenty-five dollars and is on sale for twenty percent off, the discount
is five dollars, so the sale price is twenty dollars. If sales tax of eight percent is added
afterwards, the tax is one dollar and sixty cents, and the total comes to twenty-one dollars and
sixty cents. Note that taking twenty percent off and then adding eight percent is not the same as
taking twelve percent off: percentages apply to different amounts at each step.""",
    # --- nature and travel -------------------------------------------------------------------
    """In early autumn the forest above the village turns from green to copper. Beech leaves go
first, then the birches, and last of all the oaks, which hold their brown leaves well into
winter. Mushrooms push up through the moss after the first heavy rains: some edible, many not,
and a few deadly. Red deer come down from the high ground at dusk, and if you stand still at the
edge of the clearing you can hear the stags calling across the valley, a deep, rough sound that
carries for kilometres.""",
    """The night train to the coast leaves a little before midnight. The sleeping compartments
have four narrow bunks, a tiny sink, and a window with a blind that never quite closes. You fall
asleep somewhere among the wheat fields and wake to grey light, gulls, and the smell of salt
through the gap in the window. At the last station a man sells coffee from a cart on the
platform, and everyone who steps off the train seems to buy one, standing in a loose crowd,
blinking at the sea.""",
    # --- health and sport --------------------------------------------------------------------
    """Sleep is when the body repairs itself and the brain sorts through the day. Most adults need
between seven and nine hours a night. Going to bed and getting up at the same time every day,
even at weekends, helps set the body's internal clock. Bright screens late in the evening can
delay sleep, as can caffeine in the afternoon. A cool, dark, quiet bedroom makes it easier to
fall asleep and to stay asleep until morning.""",
    """In football, each team has eleven players, one of whom is the goalkeeper, the only player
allowed to handle the ball inside their own penalty area. A match lasts ninety minutes, split
into two halves of forty-five, with extra time added for stoppages. A goal counts when the whole
ball crosses the goal line between the posts and under the crossbar. The offside rule, which
confuses many new fans, stops attackers from simply waiting beside the opposing goal for a long
pass.""",
    # --- poetry ------------------------------------------------------------------------------
    """Rain on the tin roof, steady as a clock,
the kettle thinking about singing,
the cat asleep on yesterday's news.
Somewhere a gutter overflows and laughs.
I have nowhere to be until the light comes back,
and nothing to mend but this cup of tea,
and I mend it slowly, sip by sip.""",
)

# Each dialogue is a list of (role, text) turns, rendered with the model's own chat template.
DIALOGUES: tuple[tuple[tuple[str, str], ...], ...] = (
    (
        ("user", "What is the capital of France?"),
        ("assistant", "The capital of France is Paris. It lies on the river Seine in the north of "
                      "the country and is known for the Eiffel Tower, the Louvre and its food."),
        ("user", "And what is the capital of Italy?"),
        ("assistant", "The capital of Italy is Rome, a city with nearly three thousand years of "
                      "history, home to the Colosseum and the Vatican."),
    ),
    (
        ("user", "Why is the sky blue?"),
        ("assistant", "Sunlight contains every colour. When it passes through the air, the short "
                      "blue wavelengths are scattered by gas molecules much more than the long red "
                      "ones, so blue light reaches your eyes from every direction of the sky. At "
                      "sunset the light crosses much more air, most of the blue is scattered away, "
                      "and the remaining reds and oranges colour the clouds."),
    ),
    (
        ("user", "Can you write a short poem about a cat?"),
        ("assistant", "A cat upon the windowsill\nsits quiet, watchful, perfectly still;\n"
                      "she counts the birds, she weighs the breeze,\nthen falls asleep with "
                      "practised ease."),
    ),
    (
        ("user", "How do I reverse a list in Python?"),
        ("assistant", "There are two common ways. `my_list.reverse()` reverses the list in place "
                      "and returns None, while `my_list[::-1]` returns a new reversed copy and "
                      "leaves the original unchanged. If you only need to loop backwards, "
                      "`for item in reversed(my_list):` avoids making a copy."),
    ),
    (
        ("user", "I have eggs, spinach and some cheese. What can I cook for dinner?"),
        ("assistant", "A spinach and cheese omelette would be quick and filling. Wilt the spinach "
                      "in a hot pan with a little butter, pour in three beaten eggs seasoned with "
                      "salt and pepper, let them set for a minute, then scatter the cheese over one "
                      "half and fold. Serve it with bread or a simple salad."),
        ("user", "Thanks! How long does it take?"),
        ("assistant", "About ten minutes from start to finish, including washing the spinach."),
    ),
    (
        ("user", "Tell me a fun fact about octopuses."),
        ("assistant", "An octopus has three hearts and blue blood. Two hearts pump blood through "
                      "the gills, and the third pumps it around the rest of the body. Its blood "
                      "uses a copper-based molecule to carry oxygen, which is why it is blue."),
    ),
    (
        ("user", "Who was the first person to walk on the Moon?"),
        ("assistant", "Neil Armstrong was the first person to walk on the Moon, on the twentieth "
                      "of July 1969, during the Apollo 11 mission. Buzz Aldrin joined him on the "
                      "surface shortly afterwards, while Michael Collins stayed in orbit."),
    ),
    (
        ("user", "What is 15 multiplied by 12?"),
        ("assistant", "15 multiplied by 12 is 180. One way to see it: 15 times 10 is 150, and 15 "
                      "times 2 is 30, so the total is 150 plus 30, which is 180."),
    ),
    (
        ("user", "Give me three tips for learning a new language."),
        ("assistant", "First, practise a little every day rather than a lot once a week; short, "
                      "regular sessions stick better. Second, listen to the language as much as "
                      "you can, through podcasts, songs or films with subtitles. Third, speak from "
                      "the start, even badly: mistakes are how you learn what sounds right."),
    ),
    (
        ("user", "Summarise the water cycle in two sentences."),
        ("assistant", "The Sun heats water in oceans, lakes and rivers, which evaporates, rises, "
                      "cools and condenses into clouds. The water falls back as rain or snow, "
                      "flows into rivers and the ground, and returns to the sea to begin again."),
    ),
)
