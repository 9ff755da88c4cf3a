"""The Pydantic models and tools the client suite asks for, each with a prompt the bundled model
answers well at temperature 0.

Strings carry maxLength and numbers bounds (a 135M model left free writes digits and letters on and
on), so the answers of the non-recursive shapes are short (10 to 45 tokens here, a tool call's
markup included): one cut by MAX_TOKENS there is the server's doing (a schema left open, a call
repeated), not the model's."""

from __future__ import annotations

import datetime as dt
import enum
from typing import Annotated, Literal, Optional

from pydantic import BaseModel, Field, StringConstraints

MAX_TOKENS = 80
RATE_MAX_TOKENS = 64  # the JSON-without-a-schema rates: a City is about 25 tokens
Short = Annotated[str, StringConstraints(max_length=24)]


class City(BaseModel):
    """A city."""

    name: Short
    country: Short
    population_millions: int = Field(ge=0, le=100)


class Address(BaseModel):
    street: Short
    city: Short


class Person(BaseModel):
    """A person (nested object through $defs)."""

    name: Short
    age: int = Field(ge=0, le=120)
    address: Address


class Post(BaseModel):
    """A list with item bounds."""

    title: Short
    tags: list[Short] = Field(min_length=1, max_length=3)


class Colour(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Paint(BaseModel):
    """An Enum (through $ref) and a Literal."""

    colour: Colour
    finish: Literal["matte", "gloss"]


class Contact(BaseModel):
    """Optional fields (anyOf with null)."""

    name: Short
    nickname: Optional[Short] = None
    email: Optional[Short] = None


class Commute(BaseModel):
    """One $defs entry used twice."""

    home: Address
    work: Address


class Node(BaseModel):
    """A recursive tree (unbounded depth: the one shape whose answer may rightly be cut)."""

    label: Annotated[str, StringConstraints(max_length=12)]
    children: list[Node] = Field(max_length=2)


class Flight(BaseModel):
    """A string pattern."""

    code: Annotated[str, StringConstraints(pattern=r"^[A-Z]{3}-[0-9]{3}$")]


class Order(BaseModel):
    """Number bounds and a date-time."""

    price: float = Field(ge=0, le=1000)
    quantity: int = Field(ge=1, le=9)
    placed_at: dt.datetime


SHAPES = [
    (Person, "Describe a person who lives in Rome as JSON."),
    (Post, "A blog post title and its tags as JSON."),
    (Paint, "Pick a paint as JSON."),
    (Contact, "A contact card for Ann as JSON."),
    (Commute, "Home and work addresses as JSON."),
    (Node, "A tree: root 'a' with two leaf children 'b' and 'c', as JSON."),
    (Flight, "A flight code as JSON."),
    (Order, "An order placed yesterday as JSON."),
]


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: Short
    unit: Literal["celsius", "fahrenheit"]


class GetTime(BaseModel):
    """The local time in a city."""

    city: Short


WEATHER_QUESTION = "What is the weather in Lyon, in celsius?"
CITY_QUESTION = "Tell me about Paris."
# prompts for the rates that only model quality decides (JSON without a schema the server enforces)
RATE_PROMPTS = ["Tell me about Paris.", "Tell me about Tokyo.", "Tell me about Cairo."]
