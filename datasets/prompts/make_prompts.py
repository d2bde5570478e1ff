"""Writes prompts.jsonl: onepass's own prompt set for deployment runs (see README.md).

Each task type pairs a few instruction templates with a list of subjects written for it; the
prompts are every template × subject combination the table below names, in a fixed order, so
the file is reproducible byte for byte: `python3 datasets/prompts/make_prompts.py`.
"""
import json
import os

TASKS = {
    "explain": (
        ["Explain {} to a ten-year-old.", "What is {}? Answer in two or three sentences.", "Why does {} matter?"],
        ["photosynthesis", "gravity", "inflation", "the water cycle", "vaccines", "compound interest", "black holes",
         "the immune system", "electricity", "democracy", "plate tectonics", "machine learning", "the greenhouse effect",
         "supply and demand", "DNA", "the internet"],
    ),
    "howto": (
        ["How do I {}?", "Give me three tips to {}."],
        ["make a good cup of tea", "start running regularly", "learn a new language", "sleep better", "save money on groceries",
         "write a cover letter", "keep houseplants alive", "prepare for a job interview", "organise my desk",
         "cook rice on the stove", "stop procrastinating", "make friends in a new city", "change a flat bicycle tyre",
         "study for an exam", "reduce food waste", "give a short speech"],
    ),
    "creative": (
        ["Write a short poem about {}.", "Write a four-sentence story about {}.", "Write a haiku about {}."],
        ["the sea at night", "a lost umbrella", "autumn leaves", "a robot learning to paint", "an old lighthouse",
         "the first snow", "a cat on a windowsill", "a train leaving a station", "a forgotten letter", "the moon",
         "a busy kitchen", "a garden after rain", "a child's kite", "a quiet library"],
    ),
    "facts": (
        ["{}", "{} Answer briefly."],
        ["What is the capital of Australia?", "Who wrote Pride and Prejudice?", "How many continents are there?",
         "What is the boiling point of water at sea level in Celsius?", "Which planet is known as the red planet?",
         "What language is spoken in Brazil?", "Who painted the Mona Lisa?", "What is the largest ocean on Earth?",
         "How many legs does a spider have?", "What gas do plants absorb from the air?",
         "In which year did the first person walk on the moon?", "What is the chemical symbol for gold?",
         "What is the tallest mountain in the world?", "How many days are in a leap year?"],
    ),
    "math": (
        ["Solve this and show your steps: {}"],
        ["A shirt costs $20 and is on sale for 15% off. What is the sale price?",
         "If a train travels 180 km in 2 hours, what is its average speed?", "What is 17 multiplied by 23?",
         "A recipe needs 3 eggs for 4 people. How many eggs for 10 people?", "What is the area of a circle with radius 3?",
         "Tom has 5 apples and gives away 2, then buys 7 more. How many does he have?",
         "What is 2 to the power of 10?", "Convert 5 kilometres to miles.",
         "If x + 7 = 19, what is x?", "A rectangle is 8 m by 5 m. What is its perimeter?",
         "What is the average of 4, 8, 15, 16 and 23?", "How many minutes are in three and a half hours?",
         "What is 144 divided by 12, plus 9?", "A car uses 6 litres per 100 km. How much fuel for 250 km?",
         "What is 30% of 250?", "If a dozen eggs costs $3, how much do 30 eggs cost?"],
    ),
    "code": (
        ["Write a Python function that {}.", "Explain briefly how you would {} in Python."],
        ["reverses a string", "checks whether a number is prime", "counts the words in a sentence",
         "returns the largest element of a list", "removes duplicates from a list", "computes the factorial of n",
         "checks whether a word is a palindrome", "merges two sorted lists", "converts Celsius to Fahrenheit",
         "reads a text file and counts its lines", "finds the second smallest number in a list",
         "sums the digits of an integer"],
    ),
    "advice": (
        ["{} What would you suggest?"],
        ["I feel nervous before presentations.", "My coworker keeps interrupting me in meetings.",
         "I want to eat healthier but I have little time to cook.", "I can't decide between two job offers.",
         "My friend forgot my birthday and I feel hurt.", "I have trouble staying focused when working from home.",
         "I want to read more books this year.", "My neighbour plays loud music late at night.",
         "I am starting university next month and feel anxious.", "I want to get back into exercise after an injury.",
         "I spend too much time on my phone.", "I have to tell my team some bad news.",
         "I want to learn to draw but I think I have no talent.", "My houseplants keep dying.",
         "I have a long flight coming up and get bored easily.", "I am not sure how to ask for a raise."],
    ),
    "compare": (
        ["What are the main differences between {}?", "Compare {} in a short paragraph."],
        ["cats and dogs as pets", "renting and buying a home", "trains and planes for a 500 km trip",
         "e-books and paper books", "tea and coffee", "working from home and working in an office",
         "summer and winter holidays", "Python and JavaScript", "solar and wind power", "running and swimming",
         "city life and country life", "email and phone calls"],
    ),
    "rewrite": (
        ["Rewrite this sentence to sound more polite: \"{}\"", "Summarise in one sentence: \"{}\""],
        ["Send me the report now.", "Your idea will never work.", "I need you to fix this today.",
         "Stop making so much noise.", "This food is bad.", "You are late again.", "Give me a refund.",
         "Move your car, it's blocking mine.", "We changed the meeting, deal with it.",
         "I don't have time for your questions.", "Answer my email.", "The hotel room was dirty and the staff were rude."],
    ),
    "brainstorm": (
        ["List five ideas for {}.", "Suggest a few names for {}."],
        ["a rainy weekend at home", "a birthday present for a grandparent", "a school science project",
         "a small vegetable garden", "a team-building activity", "a healthy breakfast", "a bakery",
         "a podcast about history", "a board game night", "a short road trip", "a reading club", "a pet goldfish"],
    ),
    "opinion": (
        ["Give a balanced view: {}"],
        ["Should homework be banned in primary schools?", "Is it better to travel alone or with friends?",
         "Should cities ban cars from their centres?", "Are video games good for children?",
         "Should everyone learn to code?", "Is social media good for society?",
         "Should museums be free to enter?", "Is it worth learning to play a musical instrument as an adult?",
         "Should the school day start later?", "Are electric cars better for the environment?",
         "Should people work four days a week?", "Is it better to rent or own books?"],
    ),
    "writing": (
        ["Write a short email to {}.", "Write a brief note to {}."],
        ["thank a colleague for their help", "ask a landlord to repair a leaking tap", "invite friends to a picnic",
         "apologise for missing a meeting", "ask a teacher for an extension", "welcome a new team member",
         "cancel a dentist appointment", "congratulate a friend on a new job", "request a day off",
         "ask a shop about a delayed order", "thank a host after dinner", "remind a group about a deadline"],
    ),
}


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    rows = []
    for task, (templates, subjects) in TASKS.items():
        for t_i, template in enumerate(templates):
            for s_i, subject in enumerate(subjects):
                rows.append({"id": f"{task}-{t_i}-{s_i:02d}", "task": task, "prompt": template.format(subject)})
    # interleave task types so that the first N prompts cover every type
    by_task = {}
    for r in rows:
        by_task.setdefault(r["task"], []).append(r)
    order = []
    while any(by_task.values()):
        for task in TASKS:
            if by_task[task]:
                order.append(by_task[task].pop(0))
    with open(os.path.join(here, "prompts.jsonl"), "w", encoding="utf-8") as f:
        for r in order:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"{len(order)} prompts over {len(TASKS)} task types")


if __name__ == "__main__":
    main()
