"""The texts of ``kvcache bench spec``'s workloads (bench/spec.py): a Python file to edit, the
file as a prediction, another file as a prediction that misses, a document to quote, a story."""

CODE = '''"""Read a CSV file of orders and print a summary per customer."""

import csv
import sys
from collections import defaultdict
from dataclasses import dataclass


@dataclass
class Order:
    customer: str
    item: str
    quantity: int
    price: float

    @property
    def total(self) -> float:
        return self.quantity * self.price


def parse_line(row: list[str]) -> Order:
    customer, item, quantity, price = row
    return Order(customer.strip(), item.strip(), int(quantity), float(price))


def read_orders(path: str) -> list[Order]:
    orders = []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        next(reader)  # skip the header
        for row in reader:
            if not row:
                continue
            orders.append(parse_line(row))
    return orders


def summarize(orders: list[Order]) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for order in orders:
        totals[order.customer] += order.total
    return dict(totals)


def print_summary(totals: dict[str, float]) -> None:
    width = max((len(name) for name in totals), default=8)
    for name, total in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"{name:<{width}}  {total:>10.2f}")
    print(f"{'all':<{width}}  {sum(totals.values()):>10.2f}")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: orders.py FILE", file=sys.stderr)
        return 2
    orders = read_orders(argv[1])
    print_summary(summarize(orders))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
'''
EDIT = ("Here is a Python file:\n\n```python\n" + CODE + "```\n\nRename the function `parse_line` to `parse_row` "
        "everywhere it appears. Reply with the complete updated file and nothing else.")
EDIT_PREDICTION = "```python\n" + CODE + "```"  # the file as the answer writes it
MISS = '''```python
"""Count the words of a text file and print the most common ones."""

import re
import sys
from collections import Counter

WORD = re.compile(r"[a-z']+")


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def top(counts: Counter[str], n: int = 10) -> list[tuple[str, int]]:
    return counts.most_common(n)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: wordcount.py FILE [N]", file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        counts = Counter(words(f.read()))
    n = int(argv[2]) if len(argv) > 2 else 10
    for word, count in top(counts, n):
        print(f"{count:>8}  {word}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
```'''  # a prediction that misses: another file (sent by mistake), Python all the same

DOCUMENT = """\
The Eastport Harbor Museum opened in 1921 in the old customs house on Water Street, a granite building that once \
collected duties on every cargo landed in the town. For its first thirty years the museum was run entirely by \
volunteers, most of them retired sailors and fishermen who donated their own charts, tools and logbooks. In 1954 the \
town council bought the neighbouring sail loft and joined the two buildings with a glass corridor, which doubled the \
space for exhibitions. Today the museum holds more than twelve thousand objects and welcomes about ninety thousand \
visitors a year, a third of them school children.

The lighthouse on Gull Point is the museum's best-known property. It was built in 1868 from brick and painted white \
with a single red band, and its light could be seen twenty-two miles out to sea. The original Fresnel lens, made in \
Paris and shipped across the Atlantic in eleven wooden crates, was replaced by an electric beacon in 1962 and is now \
displayed in the main hall of the museum. Visitors can climb the one hundred and twelve steps of the tower from May \
to September, when the weather allows, and the keeper's cottage at its foot has been restored to look as it did in \
1900.

The boat collection fills the former sail loft. It includes a dory built in 1890 for cod fishing on the Grand Banks, \
a racing sloop that won the Eastport regatta nine years in a row, and a steam launch whose engine still runs on the \
first Saturday of every month. Each boat is shown with the tools that were used to build it, and a workshop at the \
back of the hall lets visitors watch the museum's two boatbuilders repair planks, caulk seams and carve new oars by \
hand.

The map room on the second floor holds charts of the coast from 1702 to the present day. The oldest chart was drawn \
by a French navigator who spent a winter in the harbor after his ship lost its mast in a storm. Later charts show how \
the sandbar at the mouth of the river moved north by almost half a mile over two centuries, and how the town built \
the long breakwater in 1887 to protect the fishing fleet. Researchers may ask to see the charts that are not on \
display by writing to the curator at least two weeks before their visit.

The museum is open every day from ten in the morning to five in the afternoon, except on Mondays from November to \
March, when it is closed for cleaning and repairs. On Thursdays in July and August it stays open until eight in the \
evening, and a local band plays sea shanties on the terrace. The museum is also closed on the first of January and \
the twenty-fifth of December. The last admission is forty-five minutes before closing time, and the lighthouse tower \
closes an hour earlier than the museum.

Tickets cost twelve dollars for adults and eight dollars for students and visitors over sixty-five. Children under \
twelve enter free when they come with an adult, and school groups are free on weekdays if they book in advance. A \
family pass for two adults and up to four children costs thirty dollars. Members of the Friends of the Museum enter \
free all year and receive the quarterly newsletter, which describes new acquisitions and the results of the \
museum's research.

The café on the ground floor looks out over the harbor and serves fish chowder, sandwiches, cakes and hot drinks \
from eleven until four. It uses fish landed that morning at the town pier, and the recipe for the chowder comes from \
a cookbook written in 1910 by the wife of the last lighthouse keeper. Visitors do not need a museum ticket to use the \
café, which can be entered directly from the street.

All the galleries on the ground floor can be reached by wheelchair, and a lift connects them with the map room on \
the second floor. The lighthouse tower, however, can only be reached by its narrow stairs, so the museum offers a \
short film of the view from the top in a small room next to the main hall. Large-print guides and audio guides in \
five languages can be borrowed at the front desk without charge, and guide dogs are welcome everywhere in the museum.

The education department runs workshops for schools on knots, navigation by the stars, the life of the fishing \
families and the science of tides. During the summer holidays it offers a week-long course for children aged nine \
to fourteen, who build a small wooden boat and sail it on the last day. Teachers can borrow boxes of objects, \
photographs and activity cards to use in their own classrooms for up to a month.

The museum depends on about one hundred and forty volunteers who guide tours, catalogue objects, help in the \
workshop and keep the gardens around the lighthouse. New volunteers attend two training days in the spring and are \
then paired with an experienced guide for their first month. Anyone interested in volunteering can leave their name \
at the front desk or come to the open evening held on the last Wednesday of every month.
"""
QUESTION = DOCUMENT + "\nWhat are the museum's opening hours? Quote the text."
STORY = "Write a short story about a dragon."
