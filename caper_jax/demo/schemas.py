"""The five databases of the demo world: their tables, column roles, and seeded row generators.

Every database has the same *shape* under different names — a parent table, an item table that
references it, a person table, and an event table that references item and person — so that one
question template (templates.py) instantiates on every database by role (``item.num`` is
``product.price`` in ``shop`` and ``doctor.salary`` in ``hospital``). Shared shape is what makes a
train/dev split by (template, database) meaningful: a dev question is a template the policy has
seen, on a database where it has not seen that template, with literal values it has not seen.

Column roles (the names templates use):

  parent: id, name, group (text category), size (integer)
  item:   id, name, kind (text category), num (real), count (integer), parent (FK -> parent.id)
  person: id, name, place (text), age (integer)
  event:  id, item (FK -> item.id), person (FK -> person.id), amount (integer), year (integer)

Values are drawn so that predicates are selective: categories are skewed (a few common, a few
rare), numbers spread over a wide range, some items have no events and some people none, so that a
wrong column, operator or literal almost always changes a query's result.
"""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Callable, Sequence

Value = int | float | str
Generator = Callable[[random.Random, int], list[Value]]

TABLE_ROLES = ("parent", "item", "person", "event")


@dataclasses.dataclass(frozen=True)
class Column:
    name: str
    role: str
    sql_type: str  # SQLite declared type: INTEGER, REAL or TEXT
    noun: str  # how a question names it ("price", "home town")
    references: tuple[str, str] | None = None  # (table, column) of a foreign key
    step: float = 1  # thresholds in questions are multiples of this (round numbers read naturally)

    @property
    def spider_type(self) -> str:
        return "text" if self.sql_type == "TEXT" else "number"

    @property
    def is_key(self) -> bool:
        return self.role in ("id", "parent", "item", "person")


@dataclasses.dataclass(frozen=True)
class Table:
    name: str
    role: str
    singular: str
    plural: str
    columns: tuple[Column, ...]

    def column(self, role: str) -> Column:
        for column in self.columns:
            if column.role == role:
                return column
        raise KeyError(f"table {self.name} has no column with role {role!r}")

    def c(self, role: str) -> str:
        """Column name of a role."""
        return self.column(role).name

    def q(self, role: str) -> str:
        """Table-qualified column name of a role (for queries that join)."""
        return f"{self.name}.{self.column(role).name}"

    def noun(self, role: str) -> str:
        return self.column(role).noun

    @property
    def primary_key(self) -> Column:
        return self.column("id")


@dataclasses.dataclass(frozen=True)
class DemoSchema:
    db_id: str
    parent: Table
    item: Table
    person: Table
    event: Table
    event_verb: str  # "<person plural> who <verb> <item plural>": "bought", "borrowed"
    generators: dict[str, dict[str, Generator]]  # table -> column -> generator of non-key values
    row_counts: dict[str, int]

    @property
    def tables(self) -> tuple[Table, ...]:
        return (self.parent, self.item, self.person, self.event)

    def table(self, name: str) -> Table:
        for table in self.tables:
            if table.name == name:
                return table
        raise KeyError(f"{self.db_id} has no table {name!r}")


# ----------------------------------------------------------------------------- value generators

FIRST_NAMES = (
    "Alice", "Bruno", "Chloe", "Daniel", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas",
    "Kemal", "Laura", "Mateo", "Nadia", "Oscar", "Priya", "Quentin", "Rosa", "Samir", "Tara",
    "Umar", "Vera", "Wei", "Ximena", "Yusuf", "Zoe", "Amir", "Bianca", "Carlos", "Dana",
)
LAST_NAMES = (
    "Adams", "Baker", "Chen", "Diaz", "Evans", "Fischer", "Garcia", "Hughes", "Ito", "Jensen",
    "Kowalski", "Lopez", "Moreau", "Novak", "Okafor", "Patel", "Quinn", "Rossi", "Silva", "Tanaka",
    "Ueda", "Varga", "Weber", "Xu", "Young", "Zimmer",
)
CITIES = ("Lisbon", "Oslo", "Denver", "Osaka", "Lyon", "Austin", "Porto", "Munich", "Seattle", "Turin")
COUNTRIES = ("France", "Japan", "Brazil", "Canada", "Germany", "India", "Italy", "Kenya", "Spain")


def _skewed(values: Sequence[str], rng: random.Random) -> list[float]:
    """Zipf-like weights in a seeded order, so some values are common and some rare."""
    order = list(values)
    rng.shuffle(order)
    rank = {v: i for i, v in enumerate(order)}
    return [1.0 / (1 + rank[v]) ** 0.8 for v in values]


def categorical(values: Sequence[str]) -> Generator:
    def draw(rng: random.Random, n: int) -> list[Value]:
        weights = _skewed(values, rng)
        return list(rng.choices(values, weights=weights, k=n))
    return draw


def integers(low: int, high: int) -> Generator:
    def draw(rng: random.Random, n: int) -> list[Value]:
        return [rng.randint(low, high) for _ in range(n)]
    return draw


def money(low: float, high: float, cents: bool = True) -> Generator:
    """Log-uniform amounts (many cheap, few expensive), rounded like prices are."""
    def draw(rng: random.Random, n: int) -> list[Value]:
        out = []
        for _ in range(n):
            x = math.exp(rng.uniform(math.log(low), math.log(high)))
            out.append(round(x, 2) if cents else float(round(x)))
        return out
    return draw


def unique_combinations(first: Sequence[str], second: Sequence[str], sep: str = " ") -> Generator:
    """Distinct names from two word lists ("Silver Lamp"), so a name identifies one row."""
    def draw(rng: random.Random, n: int) -> list[Value]:
        pool = [f"{a}{sep}{b}" for a in first for b in second]
        if n > len(pool):
            raise ValueError(f"asked for {n} unique names, only {len(pool)} combinations")
        return list(rng.sample(pool, n))
    return draw


def person_names() -> Generator:
    return unique_combinations(FIRST_NAMES, LAST_NAMES)


def codes(prefix: str) -> Generator:
    def draw(rng: random.Random, n: int) -> list[Value]:
        numbers = rng.sample(range(100, 1000), n)
        return [f"{prefix}{k}" for k in numbers]
    return draw


def fixed_names(names: Sequence[str]) -> Generator:
    def draw(rng: random.Random, n: int) -> list[Value]:
        if n > len(names):
            raise ValueError(f"asked for {n} names, only {len(names)} available")
        return list(rng.sample(list(names), n))
    return draw


# ----------------------------------------------------------------------------- schema builders

def _pk(name: str) -> Column:
    return Column(name, "id", "INTEGER", "id")


def _fk(name: str, role: str, table: str, column: str, noun: str) -> Column:
    return Column(name, role, "INTEGER", noun, references=(table, column))


def _schema(db_id: str, *, parent: tuple, item: tuple, person: tuple, event: tuple, verb: str,
            generators: dict[str, dict[str, Generator]], rows: dict[str, int]) -> DemoSchema:
    tables = []
    for role, (name, singular, plural, columns) in zip(TABLE_ROLES, (parent, item, person, event)):
        tables.append(Table(name, role, singular, plural, tuple(columns)))
    return DemoSchema(db_id, *tables, event_verb=verb, generators=generators, row_counts=rows)


def shop() -> DemoSchema:
    return _schema(
        "shop",
        parent=("supplier", "supplier", "suppliers", [
            _pk("supplier_id"), Column("name", "name", "TEXT", "name"),
            Column("country", "group", "TEXT", "country"), Column("rating", "size", "INTEGER", "rating")]),
        item=("product", "product", "products", [
            _pk("product_id"), Column("name", "name", "TEXT", "name"),
            Column("category", "kind", "TEXT", "category"), Column("price", "num", "REAL", "price", step=5),
            Column("stock", "count", "INTEGER", "stock", step=5),
            _fk("supplier_id", "parent", "supplier", "supplier_id", "supplier")]),
        person=("customer", "customer", "customers", [
            _pk("customer_id"), Column("name", "name", "TEXT", "name"),
            Column("city", "place", "TEXT", "city"), Column("age", "age", "INTEGER", "age")]),
        event=("purchase", "purchase", "purchases", [
            _pk("purchase_id"), _fk("product_id", "item", "product", "product_id", "product"),
            _fk("customer_id", "person", "customer", "customer_id", "customer"),
            Column("quantity", "amount", "INTEGER", "quantity"), Column("year", "year", "INTEGER", "year")]),
        verb="bought",
        generators={
            "supplier": {"name": unique_combinations(
                ("Acme", "Nordic", "Blue", "Golden", "Prime", "Urban", "Vista", "Delta"),
                ("Trading", "Supply", "Goods", "Imports")),
                "country": categorical(COUNTRIES), "rating": integers(1, 10)},
            "product": {"name": unique_combinations(
                ("Silver", "Compact", "Classic", "Smart", "Eco", "Deluxe", "Mini", "Pro", "Retro", "Swift",
                 "Solar", "Quiet", "Royal", "Urban"),
                ("Lamp", "Kettle", "Chair", "Backpack", "Speaker", "Blender", "Watch", "Desk", "Camera",
                 "Jacket", "Bicycle", "Mixer")),
                "category": categorical(("Kitchen", "Outdoor", "Electronics", "Furniture", "Clothing",
                                         "Toys", "Garden")),
                "price": money(4, 400), "stock": integers(0, 120)},
            "customer": {"name": person_names(), "city": categorical(CITIES), "age": integers(18, 80)},
            "purchase": {"quantity": integers(1, 12), "year": integers(2018, 2024)},
        },
        rows={"supplier": 16, "product": 140, "customer": 110, "purchase": 360},
    )


def school() -> DemoSchema:
    return _schema(
        "school",
        parent=("department", "department", "departments", [
            _pk("department_id"), Column("name", "name", "TEXT", "name"),
            Column("building", "group", "TEXT", "building"),
            Column("budget", "size", "INTEGER", "budget", step=10000)]),
        item=("course", "course", "courses", [
            _pk("course_id"), Column("title", "name", "TEXT", "title"),
            Column("subject", "kind", "TEXT", "subject"), Column("fee", "num", "REAL", "fee", step=50),
            Column("capacity", "count", "INTEGER", "capacity", step=5),
            _fk("department_id", "parent", "department", "department_id", "department")]),
        person=("student", "student", "students", [
            _pk("student_id"), Column("name", "name", "TEXT", "name"),
            Column("hometown", "place", "TEXT", "hometown"), Column("age", "age", "INTEGER", "age")]),
        event=("enrollment", "enrollment", "enrollments", [
            _pk("enrollment_id"), _fk("course_id", "item", "course", "course_id", "course"),
            _fk("student_id", "person", "student", "student_id", "student"),
            Column("grade", "amount", "INTEGER", "grade", step=5), Column("year", "year", "INTEGER", "year")]),
        verb="took",
        generators={
            "department": {"name": fixed_names((
                "Physics", "Chemistry", "History", "Economics", "Biology", "Linguistics", "Mathematics",
                "Philosophy", "Geography", "Music", "Architecture", "Statistics")),
                "building": categorical(("North Hall", "Main Hall", "Science Park", "West Wing", "Old Library")),
                "budget": integers(80000, 900000)},
            "course": {"title": unique_combinations(
                ("Intro to", "Advanced", "Applied", "Modern", "Topics in", "Seminar on", "Foundations of"),
                ("Algebra", "Optics", "Genetics", "Poetry", "Ethics", "Trade", "Climate", "Logic",
                 "Statistics", "Rhetoric", "Ecology", "Harmony", "Robotics", "Urbanism")),
                "subject": categorical(("Science", "Humanities", "Mathematics", "Arts", "Engineering",
                                        "Social Science")),
                "fee": money(100, 2500, cents=False), "capacity": integers(10, 200)},
            "student": {"name": person_names(), "hometown": categorical(CITIES), "age": integers(17, 35)},
            "enrollment": {"grade": integers(35, 100), "year": integers(2018, 2024)},
        },
        rows={"department": 12, "course": 90, "student": 150, "enrollment": 420},
    )


def library() -> DemoSchema:
    return _schema(
        "library",
        parent=("publisher", "publisher", "publishers", [
            _pk("publisher_id"), Column("name", "name", "TEXT", "name"),
            Column("country", "group", "TEXT", "country"),
            Column("founded", "size", "INTEGER", "founding year", step=10)]),
        item=("book", "book", "books", [
            _pk("book_id"), Column("title", "name", "TEXT", "title"),
            Column("genre", "kind", "TEXT", "genre"), Column("price", "num", "REAL", "price", step=5),
            Column("pages", "count", "INTEGER", "page count", step=50),
            _fk("publisher_id", "parent", "publisher", "publisher_id", "publisher")]),
        person=("member", "member", "members", [
            _pk("member_id"), Column("name", "name", "TEXT", "name"),
            Column("city", "place", "TEXT", "city"), Column("age", "age", "INTEGER", "age")]),
        event=("loan", "loan", "loans", [
            _pk("loan_id"), _fk("book_id", "item", "book", "book_id", "book"),
            _fk("member_id", "person", "member", "member_id", "member"),
            Column("days", "amount", "INTEGER", "loan length in days"),
            Column("year", "year", "INTEGER", "year")]),
        verb="borrowed",
        generators={
            "publisher": {"name": unique_combinations(
                ("Harbor", "Lantern", "Quill", "Maple", "Orbit", "Raven", "Cedar"), ("Press", "Books", "House")),
                "country": categorical(COUNTRIES), "founded": integers(1850, 2015)},
            "book": {"title": unique_combinations(
                ("The Silent", "The Last", "A Distant", "The Hidden", "Beyond the", "The Broken", "Under the",
                 "The Golden", "Winter", "The Lost"),
                ("River", "Garden", "Empire", "Signal", "Harbor", "Forest", "Mirror", "Voyage", "Kingdom",
                 "Archive", "Orchard", "Tide", "Compass", "Lantern", "Citadel")),
                "genre": categorical(("Mystery", "Fantasy", "Romance", "History", "Science", "Poetry",
                                      "Thriller", "Biography")),
                "price": money(5, 80), "pages": integers(90, 900)},
            "member": {"name": person_names(), "city": categorical(CITIES), "age": integers(12, 85)},
            "loan": {"days": integers(1, 42), "year": integers(2018, 2024)},
        },
        rows={"publisher": 18, "book": 150, "member": 120, "loan": 380},
    )


def airline() -> DemoSchema:
    return _schema(
        "airline",
        parent=("airline", "airline", "airlines", [
            _pk("airline_id"), Column("name", "name", "TEXT", "name"),
            Column("country", "group", "TEXT", "country"),
            Column("fleet_size", "size", "INTEGER", "fleet size", step=10)]),
        item=("flight", "flight", "flights", [
            _pk("flight_id"), Column("flight_number", "name", "TEXT", "flight number"),
            Column("destination", "kind", "TEXT", "destination"), Column("fare", "num", "REAL", "fare", step=25),
            Column("distance", "count", "INTEGER", "distance", step=250),
            _fk("airline_id", "parent", "airline", "airline_id", "airline")]),
        person=("passenger", "passenger", "passengers", [
            _pk("passenger_id"), Column("name", "name", "TEXT", "name"),
            Column("nationality", "place", "TEXT", "nationality"), Column("age", "age", "INTEGER", "age")]),
        event=("booking", "booking", "bookings", [
            _pk("booking_id"), _fk("flight_id", "item", "flight", "flight_id", "flight"),
            _fk("passenger_id", "person", "passenger", "passenger_id", "passenger"),
            Column("seats", "amount", "INTEGER", "number of seats"), Column("year", "year", "INTEGER", "year")]),
        verb="booked",
        generators={
            "airline": {"name": unique_combinations(
                ("Sky", "Aero", "Polar", "Sun", "Coastal", "Summit", "Falcon"), ("Air", "Airways", "Jet")),
                "country": categorical(COUNTRIES), "fleet_size": integers(8, 320)},
            "flight": {"flight_number": codes("FL"),
                       "destination": categorical(("Paris", "Tokyo", "Nairobi", "Toronto", "Madrid", "Rome",
                                                   "Delhi", "Sydney", "Lima")),
                       "fare": money(40, 1500), "distance": integers(200, 12000)},
            "passenger": {"name": person_names(),
                          "nationality": categorical(("French", "Japanese", "Brazilian", "Canadian", "German",
                                                      "Indian", "Italian", "Kenyan")),
                          "age": integers(1, 90)},
            "booking": {"seats": integers(1, 6), "year": integers(2018, 2024)},
        },
        rows={"airline": 14, "flight": 130, "passenger": 140, "booking": 400},
    )


def hospital() -> DemoSchema:
    return _schema(
        "hospital",
        parent=("department", "department", "departments", [
            _pk("department_id"), Column("name", "name", "TEXT", "name"),
            Column("wing", "group", "TEXT", "wing"), Column("beds", "size", "INTEGER", "number of beds", step=5)]),
        item=("doctor", "doctor", "doctors", [
            _pk("doctor_id"), Column("name", "name", "TEXT", "name"),
            Column("specialty", "kind", "TEXT", "specialty"),
            Column("salary", "num", "REAL", "salary", step=5000),
            Column("experience", "count", "INTEGER", "years of experience"),
            _fk("department_id", "parent", "department", "department_id", "department")]),
        person=("patient", "patient", "patients", [
            _pk("patient_id"), Column("name", "name", "TEXT", "name"),
            Column("city", "place", "TEXT", "city"), Column("age", "age", "INTEGER", "age")]),
        event=("visit", "visit", "visits", [
            _pk("visit_id"), _fk("doctor_id", "item", "doctor", "doctor_id", "doctor"),
            _fk("patient_id", "person", "patient", "patient_id", "patient"),
            Column("duration", "amount", "INTEGER", "duration in minutes", step=5),
            Column("year", "year", "INTEGER", "year")]),
        verb="visited",
        generators={
            "department": {"name": fixed_names((
                "Cardiology", "Oncology", "Pediatrics", "Radiology", "Neurology", "Orthopedics", "Emergency",
                "Dermatology", "Psychiatry", "Urology", "Geriatrics")),
                "wing": categorical(("North", "South", "East", "West")), "beds": integers(5, 120)},
            "doctor": {"name": person_names(),
                       "specialty": categorical(("Surgery", "Internal Medicine", "Pediatrics", "Cardiology",
                                                 "Neurology", "Radiology", "Dermatology")),
                       "salary": money(60000, 400000, cents=False), "experience": integers(1, 40)},
            "patient": {"name": person_names(), "city": categorical(CITIES), "age": integers(0, 95)},
            "visit": {"duration": integers(10, 120), "year": integers(2018, 2024)},
        },
        rows={"department": 11, "doctor": 80, "patient": 160, "visit": 420},
    )


SCHEMAS: tuple[Callable[[], DemoSchema], ...] = (shop, school, library, airline, hospital)


def demo_schemas() -> tuple[DemoSchema, ...]:
    return tuple(make() for make in SCHEMAS)


# ----------------------------------------------------------------------------- rows

Rows = dict[str, list[tuple[Value, ...]]]


def generate_rows(schema: DemoSchema, rng: random.Random) -> Rows:
    """Rows of every table, keys 1..n, foreign keys drawn so that some parents stay unreferenced.

    Foreign keys into item and person use skewed weights over a random 85 % subset, so a few items
    were never bought and a few people never bought anything (NOT IN / EXCEPT questions have
    answers, and LEFT-vs-inner join mistakes are visible).
    """
    rows: Rows = {}
    counts = schema.row_counts
    for table in schema.tables:
        n = counts[table.name]
        columns: dict[str, list[Value]] = {}
        for column in table.columns:
            if column.role == "id":
                columns[column.name] = list(range(1, n + 1))
            elif column.references is not None:
                target_n = counts[column.references[0]]
                columns[column.name] = _foreign_keys(rng, target_n, n)
            else:
                columns[column.name] = schema.generators[table.name][column.name](rng, n)
        rows[table.name] = list(zip(*(columns[c.name] for c in table.columns)))
    return rows


def _foreign_keys(rng: random.Random, target_n: int, n: int) -> list[Value]:
    used = rng.sample(range(1, target_n + 1), max(1, round(0.85 * target_n)))
    weights = [1.0 / (1 + i) ** 0.5 for i in range(len(used))]
    return list(rng.choices(used, weights=weights, k=n))


def create_table_sql(table: Table) -> str:
    parts = []
    for column in table.columns:
        spec = f"{column.name} {column.sql_type}"
        if column.role == "id":
            spec += " PRIMARY KEY"
        parts.append(spec)
    for column in table.columns:
        if column.references is not None:
            parts.append(f"FOREIGN KEY ({column.name}) REFERENCES {column.references[0]}({column.references[1]})")
    return f"CREATE TABLE {table.name} ({', '.join(parts)})"


def tables_json_entry(schema: DemoSchema) -> dict:
    """The Spider ``tables.json`` record of a schema (names are used verbatim as display names)."""
    column_names = [[-1, "*"]]
    column_names_natural = [[-1, "*"]]
    column_types = ["text"]
    index: dict[tuple[str, str], int] = {}
    for t, table in enumerate(schema.tables):
        for column in table.columns:
            index[(table.name, column.name)] = len(column_names)
            column_names.append([t, column.name])
            column_names_natural.append([t, column.name.replace("_", " ")])
            column_types.append(column.spider_type)
    primary_keys = [index[(t.name, t.primary_key.name)] for t in schema.tables]
    foreign_keys = [[index[(t.name, c.name)], index[c.references]]
                    for t in schema.tables for c in t.columns if c.references is not None]
    return {
        "db_id": schema.db_id,
        "table_names_original": [t.name for t in schema.tables],
        "table_names": [t.name.replace("_", " ") for t in schema.tables],
        "column_names_original": column_names,
        "column_names": column_names_natural,
        "column_types": column_types,
        "primary_keys": primary_keys,
        "foreign_keys": foreign_keys,
    }
